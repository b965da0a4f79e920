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

MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (the step computes a fixed top-k)


@dataclasses.dataclass(frozen=True)
class ToolSchema:
    """A tool a constrained request may call: its name and its arguments' JSON schema (JSON text, so that the
    constraint stays hashable)."""

    name: str
    parameters: str = "{}"


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request's output must look like; the engine turns it into a grammar over the model's tokens and masks
    every step's logits with it (`strata_jax/engine/constraints.py`).

    json_schema: the answer is one JSON value matching this schema (JSON text; '{"type": "object"}' is OpenAI's
    json_object mode). tools: the answer may call only these tools, each call's arguments following its schema, in
    the chat template's tool-call format. tool_choice: "auto" (text and/or calls), "required" (one or more calls and
    nothing else), "none" (text, no call) or a tool's name (calls of that tool only). thinking: a `<think>` block may
    open the answer; starts_in_thinking: the prompt already opened one (the answer starts inside it)."""

    json_schema: str | None = None
    tools: tuple[ToolSchema, ...] = ()
    tool_choice: str = "auto"
    thinking: bool = True
    starts_in_thinking: bool = False


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
    # None: no log-probabilities. k >= 0: each token's log-probability under the model's distribution (before
    # temperature / top-k / top-p) and its k most likely alternatives, k <= MAX_TOP_LOGPROBS.
    logprobs: int | None = None
    constraint: Constraint | None = None  # a grammar the output must follow (None: free)

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
        if self.logprobs is not None:
            number("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS, integer=True)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
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
class TokenLogprob:
    """One generated token's log-probability and the `top` most likely tokens at its position, (id, logprob) pairs
    in descending order (as many as the request's `SamplingParams.logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token behind this event's text (when the request asked)
    slot: int | None = None  # on the first event: the engine slot that serves the request (for logs and monitor)


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
