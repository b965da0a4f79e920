"""Output processing, off the engine thread: token ids in, `TokenEvent`s out.

The engine thread hands each request's new token ids (and, on its last output, why it ended) to the
`OutputProcessor`, whose own thread detokenizes them incrementally, holds back text that may be the start of a
stop string, builds the events (usage on the first, timing and draft counts on the last) and passes them to the
request's `emit`. Stop strings are matched here: on a match the processor sends the final event (the text before
the match) and asks the scheduler to free the slot; tokens the engine produced for that request meanwhile are
dropped. EOS, stop-token ids and the length limit are token-level: the scheduler decides those.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence

from strata_jax.engine.protocol import FinishReason, GenerationRequest, RequestTiming, TokenEvent, TokenLogprob
from strata_jax.tokenizer import IncrementalDecoder

log = logging.getLogger("strata_jax.engine")


class RequestStream:
    """The output side of one request: its event sink, detokenizer and held-back text. Only the output thread
    touches it after `OutputProcessor.open`; the engine thread just names it in `RequestOutput`s."""

    def __init__(self, request: GenerationRequest, emit: Callable[[TokenEvent], None], submitted: float,
                 decoder: IncrementalDecoder | None):
        self.request = request
        self.emit = emit
        self.submitted = submitted
        self.decoder = decoder
        self.held = ""  # text held back while it could be the start of a stop string
        self.sent = 0  # tokens delivered
        self.done = False  # the final event went out


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One request's new output after an engine step (engine thread -> output processor).

    finish_reason is set on the request's last output: "stop" (its last token is an EOS or stop token), "length",
    "cancelled" or "error" (with `error`). The rest is the request's usage as of this step: prompt tokens reused
    from the prefix cache, when it was admitted and produced its first token, drafts guessed and accepted, and when
    this step's results reached the host (`at`, time.monotonic()).
    """

    stream: RequestStream
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    admitted: float = 0.0
    first_token: float = 0.0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    at: float = 0.0
    retryable: bool = False  # the error is the engine's state (shutdown, watchdog), not the request's
    slot: int | None = None  # the slot serving the request (None before it has one)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id (when the request asked for log-probabilities)


def cut_stop_strings(held: str, text: str, stops: Sequence[str]) -> tuple[str, str | None, str]:
    """(text to send, the stop string matched or None, text to hold back) for new `text` after `held`: on a match
    everything before the earliest one; else all but the longest tail that could start a stop string."""
    pending = held + text
    hits = [(pending.find(s), s) for s in stops if s and s in pending]
    if hits:
        idx, s = min(hits)
        return pending[:idx], s, ""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(pending)), 0, -1):
            if pending.endswith(s[:k]):
                keep = max(keep, k)
                break
    return pending[: len(pending) - keep], None, pending[len(pending) - keep :]


class OutputProcessor:
    """Turns the engine thread's `RequestOutput`s into `TokenEvent`s on its own thread (`start`/`stop`).

    `stop_request(stream, kept)` is called (from this thread) when a stop string ended a request the engine is
    still running: free its slot; `kept` tokens of its output were delivered, the rest is dropped."""

    def __init__(self, tokenizer, stop_request: Callable[[RequestStream, int | None], None]):
        self.tokenizer = tokenizer
        self._stop_request = stop_request
        self._queue: queue.SimpleQueue[RequestOutput | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.generated = 0  # tokens delivered, all requests

    def open(self, request: GenerationRequest, emit: Callable[[TokenEvent], None], submitted: float) -> RequestStream:
        """The output side of a new request (before it is queued)."""
        decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=False) if self.tokenizer else None
        return RequestStream(request, emit, submitted, decoder)

    def put(self, output: RequestOutput) -> None:
        """Queues a request's output (any thread; the engine thread's only call)."""
        self._queue.put(output)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="strata-output", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Processes what was queued, then ends the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while (output := self._queue.get()) is not None:
            try:
                self.process(output)
            except Exception as e:  # one request's broken output must not end everyone's
                log.exception("output processing failed")
                stream = output.stream
                if not stream.done:
                    stream.done = True
                    stream.emit(TokenEvent(None, finish_reason="error", error=f"output processing failed: {e}"))
                    self._stop_request(stream, None)

    def process(self, output: RequestOutput) -> None:
        """Emits the events of one `RequestOutput` (on the output thread; synchronous for tests)."""
        stream = output.stream
        if stream.done:  # a stop string ended it: what the engine produced meanwhile is dropped
            return
        for i, token in enumerate(output.token_ids):
            last = i == len(output.token_ids) - 1
            if self._token(stream, token, output.finish_reason if last else None, output, i):
                return
        if output.finish_reason is not None and not output.token_ids:
            stream.done = True
            if output.finish_reason == "error":
                stream.emit(TokenEvent(None, finish_reason="error", error=output.error, retryable=output.retryable))
            else:
                stream.emit(TokenEvent(None, finish_reason=output.finish_reason, completion_tokens=stream.sent))

    def _token(self, stream: RequestStream, token: int, reason: FinishReason | None, output: RequestOutput,
               index: int = 0) -> bool:
        """Emits one token's event; returns whether it was the request's last."""
        sampling = stream.request.sampling
        stop_token = reason == "stop"  # an EOS / stop token ends the output without text of its own
        text = "" if stop_token or stream.decoder is None else stream.decoder.push(token)
        matched, running = None, reason is None
        if sampling.stop_strings and text:
            text, matched, stream.held = cut_stop_strings(stream.held, text, sampling.stop_strings)
            if matched is not None:
                reason = "stop_string"
        if reason is not None and matched is None and stream.held:
            text, stream.held = stream.held + text, ""
        first = stream.sent == 0
        stream.sent += 1
        self.generated += 1
        event = TokenEvent(
            token,
            text=text,
            prompt_tokens=len(stream.request.prompt_ids) if first else 0,
            cached_tokens=output.cached_tokens if first else 0,
            completion_tokens=stream.sent,
            slot=output.slot if first else None,
            logprobs=output.logprobs[index : index + 1],
        )
        if reason is None:
            stream.emit(event)
            return False
        stream.done = True
        if running:  # a stop string ended a request the engine still runs: free its slot
            self._stop_request(stream, stream.sent)
        stream.emit(dataclasses.replace(
            event, finish_reason=reason, stop_string=matched, timing=_timing(stream, output),
            draft_tokens=output.draft_tokens, accepted_draft_tokens=output.accepted_draft_tokens,
        ))
        return True


def _timing(stream: RequestStream, output: RequestOutput) -> RequestTiming:
    decode_time = output.at - output.first_token
    return RequestTiming(
        queue_wait=output.admitted - stream.submitted,
        prefill=output.first_token - output.admitted,
        time_to_first_token=output.first_token - stream.submitted,
        decode_tokens_per_s=(stream.sent - 1) / decode_time if decode_time > 0 else 0.0,
    )
