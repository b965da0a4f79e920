"""The engine loop, in its own thread: FIFO admission to free slots, prefill chunks interleaved with decode steps
(one chunk, then one step for every decoding slot, so running streams stall at most one chunk), stop handling,
cancellation and the prefix cache.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from strata_jax.loaded_model import LoadedModel
from strata_jax.engine.protocol import FinishReason, GenerationRequest, RequestTiming, TokenEvent
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.prefix_cache import PrefixCache
from strata_jax.engine.speculative import NgramDrafter
from strata_jax.engine.runner import DeviceSteps
from strata_jax.tokenizer import IncrementalDecoder

log = logging.getLogger("strata_jax.engine")


@dataclasses.dataclass
class Job:
    """A request's life inside the engine."""

    request: GenerationRequest
    emit: Callable[[TokenEvent], None]
    seed: int
    submitted: float
    slot: int = -1
    pos: int = 0  # prompt tokens already in the cache
    cached: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    last_token: int | None = None
    ple_ctx: list[np.ndarray] = dataclasses.field(default_factory=list)
    decoder: IncrementalDecoder | None = None
    held: str = ""  # text held back while it could be the start of a stop string
    admitted: float = 0.0
    first_token: float = 0.0
    sent_first: bool = False
    consumed: int = 0  # tokens in the slot's cache
    device_drafts: list[int] = dataclasses.field(default_factory=list)  # MTP guesses from the last step
    misses: int = 0  # consecutive verify windows with no draft accepted
    backoff: int = 0  # steps left without drafting
    drafted: int = 0
    accepted: int = 0

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)


@dataclasses.dataclass
class _InFlight:
    """A decode step launched but not read back yet (`overlap_steps`): its device output and the jobs it ran."""

    out: object  # jax.Array [S], on the device
    jobs: list[Job]
    sampling: tuple[np.ndarray, ...]


class Scheduler:
    """Runs the device loop. All public methods are thread-safe."""

    def __init__(self, model: LoadedModel, config: EngineConfig, steps: DeviceSteps, drafter=None):
        self.model = model
        self.config = config
        self.steps = steps
        self.tokenizer = model.tokenizer
        self.eos = set(model.config.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        c = model.config.indexer_compress_ratio if model.config.qsa else 1
        self.prefix_cache = PrefixCache(config.prefix_cache_mib << 20, kv_block=c)
        self.kv_len = steps.cache.max_len
        if drafter is None and config.draft == "ngram":
            drafter = NgramDrafter(k=config.draft_k)
        self.drafter = drafter
        self._queue: collections.deque[Job] = collections.deque()
        self._slots: list[Job | None] = [None] * config.slots
        self._cancelled: set[str] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_decode = 0.0
        self.counters = collections.Counter()
        self.max_stall = 0.0
        # Overlapped decode needs next-step inputs that live on the device: no host drafter, no PLE rows.
        self._can_overlap = (
            config.overlap_steps and drafter is None and config.draft == "none" and not model.config.ple_layers
        )
        self._in_flight: _InFlight | None = None

    # -- control -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def add(self, job: Job) -> None:
        with self._cond:
            self._queue.append(job)
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(job.prompt)
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify_all()

    def snapshot_stats(self) -> dict[str, float]:
        with self._cond:
            busy = sum(j is not None for j in self._slots)
            return {
                "requests_total": self.counters["requests"],
                "prompt_tokens_total": self.counters["prompt_tokens"],
                "generated_tokens_total": self.counters["generated"],
                "prefix_cache_hit_tokens_total": self.counters["cached_tokens"],
                "prefix_cache_snapshots": len(self.prefix_cache),
                "prefix_cache_bytes": self.prefix_cache.bytes,
                "slots_busy": busy,
                "slots_total": self.config.slots,
                "queue_length": len(self._queue),
                "decode_steps_total": self.counters["decode_steps"],
                "prefill_chunks_total": self.counters["prefill_chunks"],
                "cancelled_total": self.counters["cancelled"],
                "draft_tokens_total": self.counters["drafted"],
                "accepted_draft_tokens_total": self.counters["accepted"],
                "verify_steps_total": self.counters["verify_steps"],
                "overlapped_steps_total": self.counters["overlapped_steps"],
                "max_decode_stall_seconds": self.max_stall,
                **self.steps.placement.stats(),  # host expert tier: GPU pool hit rate, promotions (if any)
            }

    # -- the loop ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._queue and not any(self._slots) and not self._cancelled:
                    self._cond.wait()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                self._drop_cancelled_queued(cancelled)
            try:
                self._iteration(cancelled)
            except Exception as e:  # a failed step must not take the other users down with the thread
                log.exception("engine step failed")
                self._fail_all(f"engine error: {e}")
        with self._cond:
            jobs = [j for j in self._slots if j is not None] + list(self._queue)
        for job in jobs:
            job.emit(TokenEvent(None, finish_reason="error", error="engine stopped"))

    def _drop_cancelled_queued(self, cancelled: set[str]) -> None:
        for job in [j for j in self._queue if j.request.request_id in cancelled]:
            self._queue.remove(job)
            job.emit(TokenEvent(None, finish_reason="cancelled"))

    def _iteration(self, cancelled: set[str]) -> None:
        if self._in_flight is not None and (cancelled or self._admission_pending() or not self._may_overlap()):
            self._land()
        for job in list(self._slots):
            if job is not None and job.request.request_id in cancelled:
                self._finish(job, "cancelled", snapshot=False)
                self.counters["cancelled"] += 1
        self._admit()
        prefilling = sorted((j for j in self._slots if j is not None and j.prefilling), key=lambda j: j.admitted)
        if prefilling:
            self._prefill_chunk(prefilling[0])
        decoding = [j for j in self._slots if j is not None and not j.prefilling]
        if decoding and self._may_overlap():
            self._decode_overlapped(decoding)
        elif decoding:
            self._decode(decoding)

    # -- overlapped decode ----------------------------------------------------------------------------------------
    def _admission_pending(self) -> bool:
        with self._cond:
            return bool(self._queue) and any(j is None for j in self._slots)

    def _may_overlap(self) -> bool:
        """Every running request decodes, and (with a step in flight) each ran in it: the next step's tokens are
        the in-flight step's output, still on the device."""
        if not self._can_overlap:
            return False
        running = [j for j in self._slots if j is not None]
        if not running or any(j.prefilling for j in running):
            return False
        return self._in_flight is None or all(j in self._in_flight.jobs for j in running)

    def _decode_overlapped(self, jobs: list[Job]) -> None:
        """Launches the next decode step, then reads back and hands out the one launched before it (if any)."""
        s = self.config.slots
        active = np.zeros(s, bool)
        for job in jobs:
            active[job.slot] = True
        previous = self._in_flight
        if previous is None:
            tokens = np.zeros(s, np.int32)
            temperature, top_k, top_p, seed = np.zeros(s), np.zeros(s), np.ones(s), np.zeros(s)
            for job in jobs:
                tokens[job.slot] = job.last_token
                temperature[job.slot], top_k[job.slot], top_p[job.slot], seed[job.slot] = self._sampling(job)
            sampling = (temperature, top_k, top_p, seed)
        else:
            tokens, sampling = previous.out, previous.sampling  # inactive slots are masked: stale values are fine
        out = self.steps.decode_on_device(tokens, active, sampling)
        self.counters["decode_steps"] += 1
        for job in jobs:
            job.consumed += 1
        self._in_flight = _InFlight(out, jobs, sampling)
        if previous is not None:
            self.counters["overlapped_steps"] += 1
            self._hand_out(previous)

    def _land(self) -> None:
        """Reads back the step in flight (before anything that needs the host to be in step with the device)."""
        previous, self._in_flight = self._in_flight, None
        self._hand_out(previous)

    def _hand_out(self, step: _InFlight) -> None:
        out = np.asarray(step.out)
        now = time.monotonic()
        if self._last_decode:
            self.max_stall = max(self.max_stall, now - self._last_decode)
        self._last_decode = now
        for job in step.jobs:
            if self._slots[job.slot] is job:  # else it finished at the step before: this token is discarded
                self._accept(job, int(out[job.slot]))
        if not any(j is not None and not j.prefilling for j in self._slots):
            self._last_decode = 0.0

    def _admit(self) -> None:
        while True:
            with self._cond:
                free = [i for i, j in enumerate(self._slots) if j is None]
                if not free or not self._queue:
                    return
                job = self._queue.popleft()
                job.slot = free[0]
                self._slots[job.slot] = job
            job.admitted = time.monotonic()
            job.decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=False) if self.tokenizer else None
            snap = self.prefix_cache.lookup(job.prompt)
            if snap is not None:
                self.steps.write(job.slot, self.prefix_cache.restore(snap, self.kv_len))
                job.pos = job.cached = job.consumed = len(snap.tokens)
                self.counters["cached_tokens"] += job.cached
            else:
                self.steps.reset(job.slot)
            job.ple_ctx = self.model.ple_context(job.prompt[: job.pos])

    def _sampling(self, job: Job) -> tuple[float, int, float, int]:
        s = job.request.sampling
        return (float(s.temperature), int(s.top_k), float(s.top_p), job.seed)

    def _prefill_chunk(self, job: Job) -> None:
        grid = self.config.chunk
        end = min(len(job.prompt), (job.pos // grid + 1) * grid)
        n = end - job.pos
        size = next(c for c in self.config.prefill_chunks if c >= n)
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :n] = job.prompt[job.pos : end]
        rows, ctx = self.model.ple_inputs(job.ple_ctx, tokens, np.array([n]))
        following = job.prompt[end] if end < len(job.prompt) else -1
        token, drafts = self.steps.prefill(job.slot, tokens, n, following, rows, self._sampling(job))
        job.device_drafts = [int(t) for t in drafts]
        job.pos, job.ple_ctx, job.consumed = end, ctx, end
        self.counters["prefill_chunks"] += 1
        if end % self.config.snapshot_every == 0:
            self.prefix_cache.insert(job.prompt[:end], self.steps.read(job.slot))
        if not job.prefilling:
            job.first_token = time.monotonic()
            self._accept(job, token)

    def _decode(self, jobs: list[Job]) -> None:
        if hasattr(self.drafter, "propose_all"):
            drafts = self.drafter.propose_all(
                {job.slot: (job, list(job.prompt) + job.generated, self._draft_limit(job)) for job in jobs}
            )
        elif self.drafter is not None or self.config.draft == "mtp":
            drafts = {job.slot: self._propose(job) for job in jobs}
        else:
            drafts = {}
        for job in jobs:
            if job.backoff > 0 and job.slot in drafts:
                job.backoff -= 1
                drafts[job.slot] = []
        if any(drafts.values()):
            self._verify(jobs, drafts)
            return
        s = self.config.slots
        tokens = np.zeros(s, np.int32)
        active = np.zeros(s, bool)
        temperature, top_k, top_p, seed = np.zeros(s), np.zeros(s), np.ones(s), np.zeros(s)
        for job in jobs:
            tokens[job.slot], active[job.slot] = job.last_token, True
            temperature[job.slot], top_k[job.slot], top_p[job.slot], seed[job.slot] = self._sampling(job)
        ctx_layers = self._stacked_contexts(jobs)
        rows, new_ctx = self.model.ple_inputs(ctx_layers, tokens[:, None], active.astype(np.int32))
        now = time.monotonic()
        if self._last_decode:
            self.max_stall = max(self.max_stall, now - self._last_decode)
        out, drafts = self.steps.decode(tokens, active, rows, (temperature, top_k, top_p, seed))
        self._last_decode = time.monotonic()
        self.counters["decode_steps"] += 1
        for job in jobs:
            job.ple_ctx = [c[job.slot : job.slot + 1] for c in new_ctx]
            job.consumed += 1
            job.device_drafts = [int(t) for t in drafts[job.slot]]
            self._accept(job, int(out[job.slot]))
        if not any(j is not None and not j.prefilling for j in self._slots):
            self._last_decode = 0.0

    def _draft_limit(self, job: Job) -> int:
        """Drafts that can still be emitted: the verify window also emits one token of the target's own."""
        return min(
            job.request.sampling.max_tokens - len(job.generated) - 1,
            self.config.max_context - len(job.prompt) - len(job.generated) - 1,
        )

    def _propose(self, job: Job) -> list[int]:
        limit = self._draft_limit(job)
        if self.drafter is None:  # MTP: the guesses came back with the last step
            return job.device_drafts[: max(limit, 0)]
        return self.drafter.propose(job.prompt + tuple(job.generated), limit)

    def _verify(self, jobs: list[Job], drafts: dict[int, list[int]]) -> None:
        """One verify call for every decoding slot (slots without drafts ride along as plain decode)."""
        s, width = self.config.slots, self.config.draft_k + 1
        tokens = np.zeros((s, width), np.int32)
        n_valid = np.zeros(s, np.int32)
        temperature, top_k, top_p, seed = np.zeros(s), np.zeros(s), np.ones(s), np.zeros(s)
        for job in jobs:
            window = [job.last_token] + drafts[job.slot]
            tokens[job.slot, : len(window)] = window
            n_valid[job.slot] = len(window)
            temperature[job.slot], top_k[job.slot], top_p[job.slot], seed[job.slot] = self._sampling(job)
        contexts = self._stacked_contexts(jobs)
        rows, _ = self.model.ple_inputs(contexts, tokens, n_valid)
        now = time.monotonic()
        if self._last_decode:
            self.max_stall = max(self.max_stall, now - self._last_decode)
        n_acc, out, next_drafts = self.steps.verify(tokens, n_valid, rows, (temperature, top_k, top_p, seed))
        self._last_decode = time.monotonic()
        self.counters["verify_steps"] += 1
        keep = np.where(n_valid > 0, n_acc + 1, 0)
        new_ctx = self.model.ple_next_context(contexts, tokens, keep)
        for job in jobs:
            a = int(n_acc[job.slot])
            job.ple_ctx = [c[job.slot : job.slot + 1] for c in new_ctx]
            job.consumed += a + 1
            job.device_drafts = [int(t) for t in next_drafts[job.slot]]
            job.drafted += len(drafts[job.slot])
            job.accepted += a
            if self.config.adaptive_draft and drafts[job.slot]:
                # Drafts that keep missing cost a wider step for nothing: pause them for a while, then retry.
                job.misses = 0 if a else job.misses + 1
                if job.misses >= 3:
                    job.misses, job.backoff = 0, 8
            self.counters["drafted"] += len(drafts[job.slot])
            self.counters["accepted"] += a
            for token in out[job.slot, : a + 1]:
                if self._accept(job, int(token)):
                    break

    def _stacked_contexts(self, jobs: list[Job]) -> list[np.ndarray]:
        empty = self.model.ple_context([])
        per_slot = [empty] * self.config.slots
        for job in jobs:
            per_slot[job.slot] = job.ple_ctx
        return [np.concatenate([ctx[i] for ctx in per_slot]) for i in range(len(empty))]

    # -- output --------------------------------------------------------------------------------------------------
    def _accept(self, job: Job, token: int) -> bool:
        """Handles a newly sampled token: stop checks, text, events. Returns whether the request finished."""
        sampling = job.request.sampling
        job.generated.append(token)
        job.last_token = token
        self.counters["generated"] += 1
        stop = (token in self.eos and not sampling.ignore_eos) or token in sampling.stop_token_ids
        text = "" if stop or job.decoder is None else job.decoder.push(token)
        reason: FinishReason | None = "stop" if stop else None
        matched = None
        if sampling.stop_strings and text:
            text, matched = self._apply_stop_strings(job, text)
            if matched is not None:
                reason = "stop_string"
        total = len(job.prompt) + len(job.generated)
        if reason is None and (len(job.generated) >= sampling.max_tokens or total >= self.config.max_context):
            reason = "length"
        if reason is not None and matched is None and job.held:
            text, job.held = job.held + text, ""
        first = not job.sent_first
        job.sent_first = True
        event = TokenEvent(
            token,
            text=text,
            prompt_tokens=len(job.prompt) if first else 0,
            cached_tokens=job.cached if first else 0,
            completion_tokens=len(job.generated),
        )
        if reason is None:
            job.emit(event)
            return False
        final = dataclasses.replace(
            event, finish_reason=reason, stop_string=matched, timing=self._timing(job),
            draft_tokens=job.drafted, accepted_draft_tokens=job.accepted,
        )
        self._finish(job, reason, snapshot=True, final=final)
        return True

    def _apply_stop_strings(self, job: Job, text: str) -> tuple[str, str | None]:
        pending = job.held + text
        stops = job.request.sampling.stop_strings
        hits = [(pending.find(s), s) for s in stops if s and s in pending]
        if hits:
            idx, s = min(hits)
            job.held = ""
            return pending[:idx], s
        keep = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(pending)), 0, -1):
                if pending.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        job.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], None

    def _timing(self, job: Job) -> RequestTiming:
        end = time.monotonic()
        decode_time = end - job.first_token
        return RequestTiming(
            queue_wait=job.admitted - job.submitted,
            prefill=job.first_token - job.admitted,
            time_to_first_token=job.first_token - job.submitted,
            decode_tokens_per_s=(len(job.generated) - 1) / decode_time if decode_time > 0 else 0.0,
        )

    def _finish(self, job: Job, reason: FinishReason, snapshot: bool, final: TokenEvent | None = None) -> None:
        """Frees the job's slot (after snapshotting it for the prefix cache), then sends its last event."""
        # The state holds the first `consumed` tokens of the sequence: every generated token but the last (not fed
        # back yet), or all of them when an overlapped step or an accepted draft run fed the last one too. A stop
        # inside an accepted draft run leaves it past the sequence: then it is not a snapshot of any known prefix.
        seq = job.prompt + tuple(job.generated)
        fed = len(seq) - 1 <= job.consumed <= len(seq)
        if snapshot and job.generated and not job.prefilling and fed:
            self.prefix_cache.insert(seq[: job.consumed], self.steps.read(job.slot))
        with self._cond:
            if 0 <= job.slot < len(self._slots) and self._slots[job.slot] is job:
                self._slots[job.slot] = None
        job.emit(final or TokenEvent(None, finish_reason=reason, completion_tokens=len(job.generated)))

    def _fail_all(self, message: str) -> None:
        """Fails the running requests (queued ones wait) and rebuilds the slot cache, whose buffers a failed
        donated call may have consumed."""
        for job in [j for j in self._slots if j is not None]:
            job.emit(TokenEvent(None, finish_reason="error", error=message))
            with self._cond:
                self._slots[job.slot] = None
        self.steps.recover()
        self._in_flight = None
        self._last_decode = 0.0
