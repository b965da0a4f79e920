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

import numpy as np
from flax import nnx

from strata_jax.engine.config import EngineConfig
from strata_jax.engine.job import Job
from strata_jax.engine.placement import ExpertPlacement
from strata_jax.engine.runner import ModelRunner
from strata_jax.loaded_model import LoadedModel


@dataclasses.dataclass
class InFlight:
    """A decode step launched but not read back yet (`overlap_steps`): its device output and the jobs it ran."""

    out: object  # jax.Array [S], on the device
    jobs: list[Job]
    sampling: tuple[np.ndarray, ...]


class StepExecutor:
    """Runs prefill chunks, decode and verify steps for the scheduler (engine thread only)."""

    def __init__(self, model: LoadedModel, config: EngineConfig, runner: ModelRunner, placement: ExpertPlacement,
                 counters: collections.Counter):
        self.model = model
        self.config = config
        self.runner = runner
        self.placement = placement
        self.counters = counters
        self.in_flight: InFlight | None = None
        self.max_stall = 0.0  # longest gap between two decode steps while requests were decoding
        self._last_decode = 0.0

    def after_step(self, name: str, counts: nnx.State) -> None:
        """Between steps: the step's routing counts go to the expert placement (device arrays: no sync), and each
        decode or verify step ticks it (every N steps it may move hot experts into the pool, rewriting weights)."""
        self.placement.store_counts(counts)
        if name != "prefill":
            self.placement.tick()
        if self.placement.active:
            self.runner.weights_changed()

    def prefill(self, job: Job) -> int | None:
        """Runs `job`'s next prompt chunk (cut on the largest chunk's grid); returns the token sampled after the
        prompt's last chunk, else None."""
        grid, fill = self.config.chunk, job.fill
        end = min(len(fill), (job.pos // grid + 1) * grid)
        n = end - job.pos
        size = next(c for c in self.config.prefill_chunks if c >= n)
        tokens = np.zeros((1, size), np.int32)
        try:
            tokens[0, :n] = fill[job.pos : end]
            rows, ctx = self.model.ple_inputs(job.ple_ctx, tokens, np.array([n]))
            following = fill[end] if end < len(fill) else -1
            out = self.runner.prefill(job.slot, tokens, n, following, rows, job.sampling)
        except Exception as e:  # this step ran this job alone: the failure is its own
            raise Job.Failed(job, e) from e
        self.after_step("prefill", out.counts)
        job.device_drafts = [int(t) for t in out.drafts]
        job.pos, job.ple_ctx, job.consumed = end, ctx, end
        self.counters["prefill_chunks"] += 1
        return None if job.prefilling else out.token

    def decode(self, jobs: list[Job]) -> dict[int, int]:
        """One decode step for `jobs`; returns slot -> sampled token."""
        tokens = np.zeros(self.config.slots, np.int32)
        active = np.zeros(self.config.slots, bool)
        for job in jobs:
            tokens[job.slot], active[job.slot] = job.last_token, True
        rows, new_ctx = self.model.ple_inputs(self._stacked_contexts(jobs), tokens[:, None], active.astype(np.int32))
        self._note_step_start()
        out = self.runner.decode(tokens, active, rows, self._sampling(jobs))
        self.after_step("decode", out.counts)
        self._last_decode = time.monotonic()
        self.counters["decode_steps"] += 1
        for job in jobs:
            job.ple_ctx = [c[job.slot : job.slot + 1] for c in new_ctx]
            job.consumed += 1
            job.device_drafts = [int(t) for t in out.drafts[job.slot]]
        return {job.slot: int(out.tokens[job.slot]) for job in jobs}

    def verify(self, jobs: list[Job], drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """One verify step for `jobs` (slots without drafts ride along as plain decode); returns slot -> emitted
        tokens: the accepted drafts, then the target's own next token."""
        s, width = self.config.slots, self.config.draft_k + 1
        tokens = np.zeros((s, width), np.int32)
        n_valid = np.zeros(s, np.int32)
        for job in jobs:
            window = [job.last_token] + drafts.get(job.slot, [])
            tokens[job.slot, : len(window)] = window
            n_valid[job.slot] = len(window)
        contexts = self._stacked_contexts(jobs)
        rows, _ = self.model.ple_inputs(contexts, tokens, n_valid)
        self._note_step_start()
        out = self.runner.verify(tokens, n_valid, rows, self._sampling(jobs))
        self.after_step("verify", out.counts)
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
        return emitted

    def launch(self, jobs: list[Job]) -> tuple[list[Job], np.ndarray] | None:
        """Launches the next decode step on the device (on the in-flight step's tokens, still there, if any), then
        reads back the step launched before it: returns its (jobs, tokens [S]), or None."""
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
        out = self.runner.decode_on_device(tokens, active, sampling)
        self.after_step("decode", out.counts)
        self.counters["decode_steps"] += 1
        for job in jobs:
            job.consumed += 1
        self.in_flight = InFlight(out.tokens, jobs, sampling)
        if previous is None:
            return None
        self.counters["overlapped_steps"] += 1
        return previous.jobs, self._read_back(previous)

    def land(self) -> tuple[list[Job], np.ndarray]:
        """Reads back the step in flight (before anything that needs the host in step with the device)."""
        previous, self.in_flight = self.in_flight, None
        return previous.jobs, self._read_back(previous)

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

    def _read_back(self, step: InFlight) -> np.ndarray:
        out = np.asarray(step.out)
        now = time.monotonic()
        if self._last_decode:
            self.max_stall = max(self.max_stall, now - self._last_decode)
        self._last_decode = now
        return out

    def _note_step_start(self) -> None:
        if self._last_decode:
            self.max_stall = max(self.max_stall, time.monotonic() - self._last_decode)

    def _sampling(self, jobs: list[Job]) -> tuple[np.ndarray, ...]:
        s = self.config.slots
        # The step's own dtypes: a value one of them cannot hold fails its job here, not the shared step.
        temperature, top_k = np.zeros(s, np.float32), np.zeros(s, np.int32)
        top_p, seed = np.ones(s, np.float32), np.zeros(s, np.uint32)
        for job in jobs:
            try:
                temperature[job.slot], top_k[job.slot], top_p[job.slot], seed[job.slot] = job.sampling
            except Exception as e:  # one job's values must not fail the step that runs everybody
                raise Job.Failed(job, e) from e
        return (temperature, top_k, top_p, seed)

    def _stacked_contexts(self, jobs: list[Job]) -> list[np.ndarray]:
        empty = self.model.ple_context([])
        per_slot = [empty] * self.config.slots
        for job in jobs:
            per_slot[job.slot] = job.ple_ctx
        return [np.concatenate([ctx[i] for ctx in per_slot]) for i in range(len(empty))]
