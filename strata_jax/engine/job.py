"""`Job`: a request's life on the engine thread, from queue to slot to finish."""

from __future__ import annotations

import dataclasses

import numpy as np

from strata_jax.engine.output import RequestOutput, RequestStream
from strata_jax.engine.protocol import FinishReason, GenerationRequest, TokenLogprob


@dataclasses.dataclass(eq=False)  # a job is itself: compared and hashed by identity
class Job:
    """A request inside the engine: where it sits, what the device has consumed, what it generated."""

    request: GenerationRequest
    stream: RequestStream  # where its output goes (the output processor's side of it)
    seed: int
    submitted: float
    slot: int = -1
    pos: int = 0  # prompt tokens already in the cache
    cached: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    last_token: int | None = None
    ple_ctx: list[np.ndarray] = dataclasses.field(default_factory=list)
    admitted: float = 0.0
    first_token: float = 0.0
    progress_at: float = 0.0  # when its prefill progress was last logged
    consumed: int = 0  # tokens in the slot's cache
    device_drafts: list[int] = dataclasses.field(default_factory=list)  # MTP guesses from the last step
    drafted: int = 0
    accepted: int = 0
    refilling: bool = False  # prefilling prompt + generated[:-1] again after the slot's state was lost
    prefill_alone: bool = False  # a prefill call it shared failed: its pieces run one job per call from then on
    snapshot_at: set[int] = dataclasses.field(default_factory=set)  # where a later prompt parts from it: snapshot
    waiting_for: Job | None = None  # a job prefilling the same first tokens: wait for its snapshot at `wait_until`
    wait_until: int = 0
    matcher: object | None = None  # constraints.GrammarMatcher: the grammar state of a constrained request
    step_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # of the last step's tokens

    class Failed(Exception):
        """Something about this one job failed (its inputs, or a step that ran it alone): fail it alone."""

        def __init__(self, job: Job, cause: BaseException):
            super().__init__(f"{type(cause).__name__}: {cause}")
            self.job = job
            self.cause = cause

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.fill)

    @property
    def host_bound(self) -> bool:
        """Each of its steps needs the host in step with the device: a grammar's mask is computed from the last
        token, log-probabilities are read back (no overlapped decode, no drafts for a grammar)."""
        return self.matcher is not None or self.request.sampling.logprobs is not None

    @property
    def sampling(self) -> tuple[float, int, float, int]:
        """(temperature, top_k, top_p, seed) for the step functions."""
        s = self.request.sampling
        return (float(s.temperature), int(s.top_k), float(s.top_p), self.seed)

    def output(self, tokens: list[int], reason: FinishReason | None, at: float, error: str | None = None,
               retryable: bool = False) -> RequestOutput:
        """This step's output of the job for the output processor, with its usage so far."""
        return RequestOutput(
            self.stream, tuple(tokens), reason, error, cached_tokens=self.cached, admitted=self.admitted,
            first_token=self.first_token, draft_tokens=self.drafted, accepted_draft_tokens=self.accepted, at=at,
            retryable=retryable, slot=self.slot if self.slot >= 0 else None,
            logprobs=self._take_logprobs(len(tokens)),
        )

    def _take_logprobs(self, n: int) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of the step's first `n` tokens (those passed on), trimmed to the request's k."""
        k = self.request.sampling.logprobs
        if k is None or not self.step_logprobs:
            return ()
        out = tuple(dataclasses.replace(lp, top=lp.top[:k]) for lp in self.step_logprobs[:n])
        self.step_logprobs = []
        return out

    @property
    def fill(self) -> tuple[int, ...]:
        """The tokens prefill must put in the slot: the prompt, plus (after the slot's state was lost to another
        request's failed step) the tokens generated so far but the last, which the next decode step feeds."""
        return self.request.prompt_ids + (tuple(self.generated[:-1]) if self.refilling else ())
