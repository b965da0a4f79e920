"""The engine's public contract, in plain Python (no JAX): what the server submits and what it gets back.

The server builds a `GenerationRequest`, calls `await engine.submit(request)` and iterates the returned async
stream of `TokenEvent`s; the last event has `finish_reason` set. Cancelling the iteration (client gone) or calling
`engine.cancel(request_id)` frees the request's slot at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "stop_string", "cancelled", "error"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos tokens
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def checked(self, vocab_size: int) -> SamplingParams:
        """These parameters made safe for the step functions, or ValueError naming the field and its range.

        The engine runs every request's sampling values inside one shared step, so a value that cannot become a
        step argument (top_k past int32, a NaN temperature) must be refused here, before it can fail the step
        for everybody. A top_k of the vocabulary size or more keeps every token: it becomes 0 (off)."""
        def number(name: str, value, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
            kind = int if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
            if not (lo < value if lo_open else lo <= value) or not value <= hi:
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
            return value

        number("max_tokens", self.max_tokens, 1, 2**31 - 1, integer=True)
        number("temperature", self.temperature, 0.0, 1e4)
        number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        number("top_k", self.top_k, 0, 2**63 - 1, integer=True)
        if self.seed is not None:
            number("seed", self.seed, -(2**63), 2**64 - 1, integer=True)
        for t in self.stop_token_ids:
            number("stop_token_ids[]", t, 0, vocab_size - 1, integer=True)
        if any(not isinstance(s, str) for s in self.stop_strings):
            raise ValueError("stop_strings must be strings")
        top_k = 0 if self.top_k >= vocab_size else self.top_k
        return self if top_k == self.top_k else dataclasses.replace(self, top_k=top_k)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """Seconds, measured by the engine."""

    queue_wait: float = 0.0
    prefill: float = 0.0
    time_to_first_token: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One step of a request's output.

    `text` is the newly completed text (incremental detokenization; may be "" while a multi-byte character is
    incomplete, and never includes a matched stop string). The first event carries `cached_tokens` (prompt tokens
    reused from the prefix cache) and `prompt_tokens`. The last event has `finish_reason`, `timing` and, for
    "stop_string", the matched `stop_string`; for "error", `error`.
    """

    token_id: int | None
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timing: RequestTiming | None = None
    draft_tokens: int = 0  # on the last event: tokens the drafter guessed for this request
    accepted_draft_tokens: int = 0  # ... and how many of them the model accepted
    retryable: bool = False  # an "error" that is the engine's state (shutting down, a stuck step), not the request's


class EngineUnavailable(RuntimeError):
    """The engine takes no requests now: it is shutting down, or its watchdog found a step stuck. Retry later
    (after a restart)."""


class PromptTooLong(ValueError):
    """The prompt (plus at least one generated token) does not fit the context."""

    def __init__(self, prompt_tokens: int, max_tokens: int):
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {max_tokens} maximum")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class EngineProtocol(Protocol):
    """What the server relies on."""

    context_length: int

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queues a request; raises PromptTooLong at once if it cannot fit, ValueError for sampling values out of
        range, EngineUnavailable while shutting down or wedged."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): False once the watchdog found a step stuck or the engine is stopping."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics: requests, tokens in/out, prefix-cache hit tokens, slots busy, queue; with
        a host expert tier also `expert_gpu_hit_rate` (routed pairs served by the GPU pool) and its counters."""
        ...
