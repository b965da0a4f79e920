"""Test seam and harness for the HTTP server.

`ScriptedEngine` implements `EngineProtocol` and streams the tokens of a given model-output text (encoded with the
fixture tokenizer, one token per event, detokenized incrementally like the engine does), so tool-call and thinking
text really flows through the server's parser. `ServerThread` runs an app on 127.0.0.1 in a background thread so
the official client SDKs can talk to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

try:  # the client SDKs' HTTP library: httpx2 in current releases, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # noqa: F401 - re-exported for the tests

from strata_jax.engine.protocol import GenerationRequest, PromptTooLong, TokenEvent
from strata_jax.tokenizer import Tokenizer, load_tokenizer

from server.listener import listen, make_runner
from strata_jax.bench.fuzz_bodies import parse_sse  # noqa: F401 - re-exported for the tests

TOKENIZER_DIR = Path(__file__).parent / "fixtures" / "tokenizer"
CLAUDE_CODE_FIXTURES = Path(__file__).parent / "fixtures" / "claude_code"


def fixture_tokenizer() -> Tokenizer:
    """The small Qwen-style fixture tokenizer (with the Qwen3-Coder chat template)."""
    return load_tokenizer(TOKENIZER_DIR)


class ScriptedEngine:
    """An engine whose "model" writes `script` (a string, or a function of the request returning one).

    Honours max_tokens ("length"), stop strings ("stop_string", text cut before the match) and ends with the eos
    token ("stop"). `first_token_delay`/`token_delay` (seconds) simulate prefill and decode time. Records submitted
    requests, cancel() calls and which requests are still streaming.
    """

    def __init__(self, tokenizer: Tokenizer, script: str | Callable[[GenerationRequest], str] = "Hello!", *,
                 context_length: int = 4096, first_token_delay: float = 0.0, token_delay: float = 0.0,
                 cached_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.context_length = context_length
        self.first_token_delay = first_token_delay
        self.token_delay = token_delay
        self.cached_tokens = cached_tokens
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.active: set[str] = set()
        self.eos_id = min(tokenizer.eos_token_ids)

    def prompt_text(self, index: int = -1) -> str:
        """The decoded prompt of a submitted request."""
        return self.tokenizer.decode(self.submitted[index].prompt_ids)

    async def submit(self, request: GenerationRequest) -> Any:
        n = len(request.prompt_ids)
        if n >= self.context_length:
            raise PromptTooLong(n, self.context_length - 1)
        text = self.script(request) if callable(self.script) else self.script
        self.submitted.append(request)
        self.active.add(request.request_id)
        return self._stream(request, self.tokenizer.encode(text))

    async def _stream(self, request: GenerationRequest, ids: list[int]) -> Any:
        sampling = request.sampling
        decoder = self.tokenizer.incremental_decoder(skip_special_tokens=False)
        stops = sampling.stop_strings
        produced = ""  # text generated so far, including held-back text
        emitted = 0  # characters of `produced` already sent
        count = 0
        first = {"prompt_tokens": len(request.prompt_ids), "cached_tokens": self.cached_tokens}
        try:
            if self.first_token_delay:
                await asyncio.sleep(self.first_token_delay)
            for tid in ids:
                if request.request_id in self.cancelled:
                    return
                count += 1
                produced += decoder.push(tid)
                extra = first if count == 1 else {}
                hit = min(((produced.find(s), s) for s in stops if s in produced), default=None)
                if hit is not None:
                    yield TokenEvent(tid, produced[emitted:hit[0]], finish_reason="stop_string", stop_string=hit[1],
                                     completion_tokens=count, **extra)
                    return
                hold = max((k for s in stops for k in range(1, len(s)) if produced.endswith(s[:k])), default=0)
                text = produced[emitted:len(produced) - hold]
                emitted += len(text)
                finish = "length" if count >= sampling.max_tokens else None
                yield TokenEvent(tid, text, finish_reason=finish, completion_tokens=count, **extra)
                if finish:
                    return
                await asyncio.sleep(self.token_delay)
            count += 1
            yield TokenEvent(self.eos_id, produced[emitted:], finish_reason="stop", completion_tokens=count,
                             **(first if count == 1 else {}))
        finally:
            self.active.discard(request.request_id)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def stats(self) -> dict[str, float]:
        return {"slots_busy": len(self.active), "queue_length": 0, "requests_total": len(self.submitted)}


class ServerThread:
    """Serves `app` on 127.0.0.1 (a free port) from a background thread's event loop."""

    def __init__(self, app: web.Application, **listen_kwargs: Any) -> None:
        """`listen_kwargs`: server.listener.listen's (max_connections, header_timeout_s)."""
        self.app = app
        self._listen_kwargs = listen_kwargs
        self._listener: asyncio.AbstractServer | None = None
        self.guard: Any = None
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0
        started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(30)
        if self._error is not None:
            raise self._error

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            started.set()
            return
        started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self._runner = make_runner(self.app, access_log=None)  # the settings `serve` runs with
        await self._runner.setup()
        self._listener, self.guard = await listen(self._runner, "127.0.0.1", 0, **self._listen_kwargs)
        self.port = self._listener.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's loop (e.g. to install an engine) and return its result."""
        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(30)

    def stop(self) -> None:
        if self._listener is not None:
            self.loop.call_soon_threadsafe(self._listener.close)
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


