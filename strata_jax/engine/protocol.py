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
        """Queues a request; raises PromptTooLong at once if it cannot fit."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics: requests, tokens in/out, prefix-cache hit tokens, slots busy, queue; with
        a host expert tier also `expert_gpu_hit_rate` (routed pairs served by the GPU pool) and its counters."""
        ...
