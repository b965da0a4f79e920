"""`StepExecutor`: carries out the scheduler's decisions on the model runner.

For each step it builds the host inputs from the jobs (tokens, per-slot sampling parameters, PLE rows), runs the
runner, hands the step's routing counts to the expert placement between steps, and records what the device
consumed in the jobs (cache position, PLE context, MTP guesses). The new tokens go back to the scheduler, which
decides what they mean (stops, finishing) and forwards them to the output processor.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np

from strata_jax.engine.call_log import CallLog
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.job import Job
from strata_jax.engine.placement import ExpertPlacement
from strata_jax.engine.protocol import TokenLogprob
from strata_jax.engine.runner import ModelRunner
from strata_jax.loaded_model import LoadedModel


class PrefillBatchFailed(Exception):
    """A prefill call that ran several jobs failed: which one's inputs caused it is not known."""

    def __init__(self, jobs: list[Job], cause: Exception):
        super().__init__(str(cause))
        self.jobs = jobs


@dataclasses.dataclass
class InFlight:
    """A step launched but not read back yet: a decode step (`overlap_steps`) or a chained verify window
    (`chain_windows`, the fields after `sampling` set). Its outputs are device arrays."""

    out: object  # tokens [S] (decode) or emitted tokens [S, width] (a window)
    jobs: list[Job]
    sampling: tuple[np.ndarray, ...]
    accepted: object = None  # [S] accepted drafts (a window)
    n_valid: object = None  # [S] 1 + drafts (0: the slot was idle)
    lengths: object = None  # [S] history lengths before the window's emitted tokens
    drafts: object = None  # [S, mtp_k] the MTP head's guesses after the window

    @property
    def kind(self) -> str:
        return "decode" if self.accepted is None else "verify"


@dataclasses.dataclass(frozen=True)
class Landed:
    """A step read back: its jobs and, per slot, its tokens ([S] decode, [S, width] window); a window's accepted
    drafts and drafts proposed ([S] each) and the history length before its emitted tokens."""

    jobs: list[Job]
    tokens: np.ndarray
    accepted: np.ndarray | None = None
    proposed: np.ndarray | None = None
    starts: dict[int, int] = dataclasses.field(default_factory=dict)

    def emitted(self, slot: int) -> list[int]:
        """The slot's new tokens: one (decode), or the accepted drafts and the target's own next token."""
        if self.accepted is None:
            return [int(self.tokens[slot])]
        return [int(t) for t in self.tokens[slot, : int(self.accepted[slot]) + 1]]


class StepExecutor:
    """Runs prefill chunks, decode and verify steps for the scheduler (engine thread only)."""

    def __init__(self, model: LoadedModel, config: EngineConfig, runner: ModelRunner, placement: ExpertPlacement,
                 counters: collections.Counter, calls: CallLog | None = None):
        self.model = model
        self.calls = calls if calls is not None else CallLog(0)
        self.config = config
        self.runner = runner
        self.placement = placement
        self.counters = counters
        self.in_flight: InFlight | None = None
        self.max_stall = 0.0  # longest gap between two decode steps while requests were decoding
        self._last_decode = 0.0

    def after_step(self, name: str) -> None:
        """Between steps (the runner has put the step's routing counts into the model's state, where the expert
        placement reads them): each decode or verify step ticks the placement. Every N steps it may move hot
        experts into the pool, rewriting weights, which the runner then re-reads (`ExpertPlacement.writes`)."""
        if name != "prefill":
            self.placement.tick()

    def chunk_size(self, job: Job, limit: int | None = None) -> int:
        """The compiled chunk width `job`'s next prompt piece runs in (a piece is at most the largest chunk, or
        `limit`, a compiled width)."""
        return next(c for c in self.config.prefill_chunks if c >= self.piece_length(job, limit))

    def piece_length(self, job: Job, limit: int | None = None) -> int:
        """Tokens of `job`'s next prompt piece when pieces are at most `limit` (default the largest chunk)."""
        return self._piece_end(job, limit) - job.pos

    def _piece_end(self, job: Job, limit: int | None = None) -> int:
        # Pieces start where the slot's cache ends, not on a grid: after a prefix restored at an arbitrary point
        # (the end of a shared system prompt), a grid cost one extra narrow call to reach it (every first turn of
        # agents arriving together paid one 1,024-wide call of 384 tokens).
        end = min(len(job.fill), job.pos + (limit or self.config.chunk))
        # A piece ends where a snapshot is due (a point where a later prompt parts from this one).
        return min([end] + [p for p in job.snapshot_at if job.pos < p < end])

    def prefill(self, jobs: list[Job], limit: int | None = None) -> dict[int, int | None]:
        """Runs the next prompt piece of each of `jobs` (distinct slots; a power-of-two count from
        `config.prefill_batches`) in one call, in the compiled width of the widest piece (narrower pieces padded);
        `limit`: the widest piece (a compiled width; default the largest chunk). Returns slot -> the token sampled
        after the prompt's last piece, or None while the prompt goes on.

        A failure of a call that ran one job is that job's (`Job.Failed`); of a call that ran several,
        `PrefillBatchFailed` (the scheduler runs them alone after it, so that the one at fault fails alone)."""
        size = max(self.chunk_size(job, limit) for job in jobs)
        p = len(jobs)
        tokens = np.zeros((p, size), np.int32)
        n_valid, following = np.zeros(p, np.int32), np.full(p, -1, np.int32)
        ends = [self._piece_end(job, limit) for job in jobs]
        try:
            sampling = self._sampling(jobs, rows=p)
            for i, (job, end) in enumerate(zip(jobs, ends)):
                n_valid[i] = end - job.pos
                tokens[i, : n_valid[i]] = job.fill[job.pos : end]
                following[i] = job.fill[end] if end < len(job.fill) else -1
            contexts = [np.concatenate(parts) for parts in zip(*(job.ple_ctx for job in jobs))]
            rows, ctx = self.model.ple_inputs(contexts, tokens, n_valid)
            masks, wanted = self._grammar(jobs, rows=p, last=[end == len(job.fill) for job, end in zip(jobs, ends)])
            pieces = tuple((job.slot, job.pos, end, len(job.fill)) for job, end in zip(jobs, ends))
            with self.calls.timed("prefill", width=size, pieces=pieces):
                out = self.runner.prefill([job.slot for job in jobs], tokens, n_valid, following, rows, sampling,
                                          masks, wanted)
        except Job.Failed:
            raise
        except Exception as e:
            if p == 1:  # this step ran this job alone: the failure is its own
                raise Job.Failed(jobs[0], e) from e
            raise PrefillBatchFailed(jobs, e) from e
        self.after_step("prefill")
        result = {}
        for i, (job, end) in enumerate(zip(jobs, ends)):
            job.device_drafts = [int(t) for t in out.drafts[i]]
            job.pos, job.consumed = end, end
            job.ple_ctx = [c[i : i + 1] for c in ctx]
            result[job.slot] = None if job.prefilling else int(out.tokens[i])
        self._read_logprobs(jobs, out.logprobs, wanted, out.tokens, rows=True)
        self.counters["prefill_chunks"] += p
        self.counters["prefill_calls"] += 1
        return result

    def decode(self, jobs: list[Job]) -> dict[int, int]:
        """One decode step for `jobs`; returns slot -> sampled token."""
        tokens = np.zeros(self.config.slots, np.int32)
        active = np.zeros(self.config.slots, bool)
        for job in jobs:
            tokens[job.slot], active[job.slot] = job.last_token, True
        rows, new_ctx = self.model.ple_inputs(self._stacked_contexts(jobs), tokens[:, None], active.astype(np.int32))
        self._note_step_start()
        sampling, grammar = self._sampling(jobs), self._grammar(jobs)
        started = time.perf_counter()
        with self.calls.timed("decode", slots=tuple(job.slot for job in jobs)):
            out = self.runner.decode(tokens, active, rows, sampling, *grammar)
        self._count_step_call(started)
        self.after_step("decode")
        self._last_decode = time.monotonic()
        self.counters["decode_steps"] += 1
        for job in jobs:
            job.ple_ctx = [c[job.slot : job.slot + 1] for c in new_ctx]
            job.consumed += 1
            job.device_drafts = [int(t) for t in out.drafts[job.slot]]
        self._read_logprobs(jobs, out.logprobs, out.logprobs is not None, out.tokens)
        return {job.slot: int(out.tokens[job.slot]) for job in jobs}

    def verify(self, jobs: list[Job], drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """One verify step for `jobs` (slots without drafts ride along as plain decode); returns slot -> emitted
        tokens: the accepted drafts, then the target's own next token."""
        # The narrowest compiled window that holds the longest draft; shorter windows in it are masked (n_valid).
        longest = 1 + max((len(drafts.get(job.slot, [])) for job in jobs), default=0)
        s, width = self.config.slots, next(w for w in self.config.verify_widths if w >= longest)
        tokens = np.zeros((s, width), np.int32)
        n_valid = np.zeros(s, np.int32)
        masks, wanted = self._grammar(jobs, width=width)
        for job in jobs:
            guesses = drafts.get(job.slot, [])
            if job.matcher is not None:  # masks along the window; drafts past one the grammar forbids are dropped
                guesses = guesses[: self._fill(job, lambda m: m.fill_window(guesses, masks[job.slot]))]
            window = [job.last_token] + guesses
            tokens[job.slot, : len(window)] = window
            n_valid[job.slot] = len(window)
        contexts = self._stacked_contexts(jobs)
        rows, _ = self.model.ple_inputs(contexts, tokens, n_valid)
        self._note_step_start()
        sampling = self._sampling(jobs)
        started = time.perf_counter()
        with self.calls.timed("verify", slots=tuple(job.slot for job in jobs), width=width):
            out = self.runner.verify(tokens, n_valid, rows, sampling, masks, wanted)
        self._count_step_call(started)
        self.after_step("verify")
        self._last_decode = time.monotonic()
        self.counters["verify_steps"] += 1
        keep = np.where(n_valid > 0, out.accepted + 1, 0)
        new_ctx = self.model.ple_next_context(contexts, tokens, keep)
        emitted = {}
        for job in jobs:
            a = int(out.accepted[job.slot])
            job.ple_ctx = [c[job.slot : job.slot + 1] for c in new_ctx]
            job.consumed += a + 1
            job.device_drafts = [int(t) for t in out.drafts[job.slot]]
            emitted[job.slot] = [int(t) for t in out.tokens[job.slot, : a + 1]]
        self._read_logprobs(jobs, out.logprobs, wanted is not None, out.tokens, counts=out.accepted + 1)
        return emitted

    def launch(self, jobs: list[Job]) -> Landed | None:
        """Launches the next decode step on the device (on the in-flight step's tokens, still there, if any), then
        reads back the step launched before it: returns it, or None."""
        s = self.config.slots
        active = np.zeros(s, bool)
        for job in jobs:
            active[job.slot] = True
        previous = self.in_flight
        if previous is None:
            tokens = np.zeros(s, np.int32)
            for job in jobs:
                tokens[job.slot] = job.last_token
            sampling = self._sampling(jobs)
        else:
            tokens, sampling = previous.out, previous.sampling  # inactive slots are masked: stale values are fine
        started = time.perf_counter()
        with self.calls.timed("launch", slots=tuple(job.slot for job in jobs)):
            out = self.runner.decode_on_device(tokens, active, sampling)
        self.after_step("decode")
        self.counters["launch_seconds"] += time.perf_counter() - started
        self.counters["decode_steps"] += 1
        for job in jobs:
            job.consumed += 1
            job.device_drafts = []  # an MTP head's guesses stay on the device: the next drafts come from a plain step
        self.in_flight = InFlight(out.tokens, jobs, sampling)
        if previous is None:
            return None
        self.counters["overlapped_steps"] += 1
        return self._read_back(previous)

    def launch_window(self, jobs: list[Job], want: dict[int, int], drafter) -> Landed | None:
        """Launches the next verify window of `jobs` on the device, built there from the window in flight (if any)
        and `drafter`'s device guesses (a `DeviceDrafter`), each slot drafting at most `want[slot]`; then reads back
        the window launched before it: returns it, or None (a chain's first window).

        The window width is the narrowest compiled one for the longest want; a slot whose drafter has fewer guesses
        rides along with fewer (masked). The caller makes sure no job can end inside the two windows' tokens by
        length (`max_tokens`, context): a stop token may, and the tokens after it are discarded."""
        s = self.config.slots
        width = next(w for w in self.config.verify_widths if w >= 1 + max(want.values()))
        active, wants = np.zeros(s, bool), np.zeros(s, np.int32)
        for job in jobs:
            active[job.slot], wants[job.slot] = True, want.get(job.slot, 0)
        previous = self.in_flight
        if previous is None:
            out, accepted = np.zeros((s, 1), np.int32), np.zeros(s, np.int32)
            lengths, step_drafts = np.zeros(s, np.int32), np.zeros((s, self.runner.mtp_k), np.int32)
            for job in jobs:
                out[job.slot, 0] = job.last_token
                lengths[job.slot] = len(job.prompt) + len(job.generated) - 1
                step_drafts[job.slot, : len(job.device_drafts)] = job.device_drafts[: self.runner.mtp_k]
            sampling = self._sampling(jobs)
        else:
            out, accepted, lengths, step_drafts = previous.out, previous.accepted, previous.lengths, previous.drafts
            sampling = previous.sampling
        started = time.perf_counter()
        tokens, n_valid, lengths = self.runner.window(drafter, out, accepted, lengths, step_drafts, wants, active,
                                                      width)
        with self.calls.timed("launch", slots=tuple(job.slot for job in jobs), width=width):
            step = self.runner.verify_on_device(tokens, n_valid, sampling)
        self.after_step("verify")
        self.counters["launch_seconds"] += time.perf_counter() - started
        self.counters["verify_steps"] += 1
        self.counters["chained_windows"] += 1
        self.in_flight = InFlight(step.tokens, jobs, sampling, step.accepted, n_valid, lengths, step.drafts)
        return None if previous is None else self._read_back(previous)

    def land(self) -> Landed:
        """Reads back the step in flight (before anything that needs the host in step with the device)."""
        previous, self.in_flight = self.in_flight, None
        return self._read_back(previous)

    def carries(self, job: Job) -> bool:
        """Whether a step in flight runs `job`: its slot's state is then ahead of what the host has read back."""
        return self.in_flight is not None and job in self.in_flight.jobs

    def idle(self) -> None:
        """No request decodes any more: the wait for the next decode step is not a stall."""
        self._last_decode = 0.0

    def state_lost(self) -> bool:
        """Whether a failed call consumed the slot cache (its donated buffers are gone)."""
        return self.runner.cache_lost()

    def recover(self) -> None:
        """After a failed step: a fresh slot cache, nothing in flight."""
        self.runner.recover()
        self.in_flight = None
        self._last_decode = 0.0

    def _read_back(self, step: InFlight) -> Landed:
        """Waits for `step` and copies its outputs to the host; a window's also go into its jobs (what the device
        consumed, the MTP head's guesses for a step that follows on the host)."""
        started = time.perf_counter()
        with self.calls.timed("land", slots=tuple(job.slot for job in step.jobs)):
            if step.kind == "decode":
                landed = Landed(step.jobs, np.asarray(step.out))
            else:
                out, accepted, n_valid, lengths, drafts = jax.device_get(
                    (step.out, step.accepted, step.n_valid, step.lengths, step.drafts))
                landed = Landed(step.jobs, out, accepted, np.maximum(n_valid - 1, 0),
                                {job.slot: int(lengths[job.slot]) for job in step.jobs})
        if step.kind != "decode":
            for job in step.jobs:
                job.consumed += int(accepted[job.slot]) + 1
                job.device_drafts = [int(t) for t in drafts[job.slot]]
        self.counters["read_back_seconds"] += time.perf_counter() - started
        now = time.monotonic()
        if self._last_decode:
            self.max_stall = max(self.max_stall, now - self._last_decode)
        self._last_decode = now
        return landed

    def _count_step_call(self, started: float) -> None:
        """A step run in step with the host (decode without overlap, verify): the time from calling the runner to
        its results on the host, i.e. the device's step plus its launch, not hidden behind anything."""
        self.counters["in_step_calls"] += 1
        self.counters["in_step_call_seconds"] += time.perf_counter() - started

    def _note_step_start(self) -> None:
        if self._last_decode:
            self.max_stall = max(self.max_stall, time.monotonic() - self._last_decode)

    def _grammar(self, jobs: list[Job], rows: int | None = None, width: int | None = None,
                 last: list[bool] | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The step's (token masks, log-probability requests) per slot (`rows` None) or per job in order: None for
        either when no job needs it (the runner then passes device-resident inputs that do nothing). Masks are
        [rows, W] or, with `width`, [rows, width, W] with the next token's mask at position 0 (the verify window's
        other positions are filled by `verify`). `last`: per job, whether this call samples its next token (a
        prefill call before a prompt's last piece needs no mask)."""
        n = self.config.slots if rows is None else rows
        at = [job.slot if rows is None else i for i, job in enumerate(jobs)]
        sampled = last or [True] * len(jobs)
        masks = wanted = None
        if any(job.matcher is not None and s for job, s in zip(jobs, sampled)):
            shape = (n, width) if width else (n,)
            masks = np.full(shape + (self.runner.mask_words,), -1, np.int32)
            for i, job, s in zip(at, jobs, sampled):
                if job.matcher is not None and s and not width:  # verify fills its windows itself
                    self._fill(job, lambda m, row=(masks[i, 0] if width else masks[i]): m.fill(row))
        if any(job.request.sampling.logprobs is not None for job in jobs):
            wanted = np.zeros(n, bool)
            for i, job in zip(at, jobs):
                wanted[i] = job.request.sampling.logprobs is not None
        return masks, wanted

    @staticmethod
    def _fill(job: Job, fill):
        """Runs a mask computation of `job`'s matcher; its failure is the job's alone."""
        try:
            return fill(job.matcher)
        except Exception as e:  # noqa: BLE001 - one grammar must not fail the step that runs everybody
            raise Job.Failed(job, e) from e

    def _read_logprobs(self, jobs: list[Job], logprobs, wanted, tokens: np.ndarray, rows: bool = False,
                       counts: np.ndarray | None = None) -> None:
        """Copies the step's log-probabilities of the jobs that asked into `job.step_logprobs` (one per emitted
        token; `counts` per slot for a verify window; `rows`: prefill's outputs are per job, not per slot)."""
        if logprobs is None or wanted is None or wanted is False:
            return
        chosen, top_ids, top_lp = (np.asarray(a) for a in logprobs)
        for i, job in enumerate(jobs):
            if job.request.sampling.logprobs is None:
                continue
            at = i if rows else job.slot
            if tokens.ndim == 1:
                job.step_logprobs = [_token_logprob(int(tokens[at]), chosen[at], top_ids[at], top_lp[at])]
            else:
                job.step_logprobs = [_token_logprob(int(tokens[at, j]), chosen[at, j], top_ids[at, j], top_lp[at, j])
                                     for j in range(int(counts[at]))]

    def _sampling(self, jobs: list[Job], rows: int | None = None) -> tuple[np.ndarray, ...]:
        """Per-slot sampling arrays [S] (`rows` None), or per-job arrays [rows] in the order of `jobs`."""
        s = self.config.slots if rows is None else rows
        # The step's own dtypes: a value one of them cannot hold fails its job here, not the shared step.
        temperature, top_k = np.zeros(s, np.float32), np.zeros(s, np.int32)
        top_p, seed = np.ones(s, np.float32), np.zeros(s, np.uint32)
        for i, job in enumerate(jobs):
            at = job.slot if rows is None else i
            try:
                temperature[at], top_k[at], top_p[at], seed[at] = job.sampling
            except Exception as e:  # one job's values must not fail the step that runs everybody
                raise Job.Failed(job, e) from e
        return (temperature, top_k, top_p, seed)

    def _stacked_contexts(self, jobs: list[Job]) -> list[np.ndarray]:
        empty = self.model.ple_context([])
        per_slot = [empty] * self.config.slots
        for job in jobs:
            per_slot[job.slot] = job.ple_ctx
        return [np.concatenate([ctx[i] for ctx in per_slot]) for i in range(len(empty))]


def _token_logprob(token: int, logprob, top_ids: np.ndarray, top_lp: np.ndarray) -> TokenLogprob:
    return TokenLogprob(token, float(logprob), tuple((int(t), float(v)) for t, v in zip(top_ids, top_lp)))
