"""The engine loop, in its own thread. The scheduler decides; the `StepExecutor` runs its decisions on the model
runner; the `OutputProcessor` (its own thread) turns the tokens into events.

Each iteration: cancellations and stop-string ends free their slots, FIFO admission fills free slots (restoring
prefix-cache snapshots, or waiting for the snapshot of a prompt that is prefilling the same first tokens), one
prefill call runs the prompt pieces the prefill policy picks (strata_jax/engine/prefill_policy.py: narrow and paced
while slots decode, shortest remaining first), then every decoding slot gets one step: verify when the drafter has
guesses, else decode. Steps overlap the host's work while nothing needs the host in step with the device (no PLE
rows, grammar masks or log-probabilities): decode steps while no slot drafts (paused drafts do not count), and
verify windows chained on the device while the drafter guesses there too (`DeviceDrafter`, `chain_windows`) and
no request can end by length inside the next two windows.
Prefix snapshots are copied to the host asynchronously. The scheduler decides token-level ends (EOS, stop-token
ids, length); stop strings are text-level and matched by the output processor.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

from strata_jax.engine.call_log import CallLog
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.draft_policy import DraftLengths
from strata_jax.engine.drafters import DeviceDrafter, DraftRequest, Drafter
from strata_jax.engine.executor import Landed, PrefillBatchFailed, StepExecutor
from strata_jax.engine.job import Job
from strata_jax.engine.output import OutputProcessor, RequestStream
from strata_jax.engine.placement import ExpertPlacement
from strata_jax.engine.prefill_policy import PrefillPolicy
from strata_jax.engine.prefix_cache import PrefixCache, shared_length
from strata_jax.engine.protocol import FinishReason
from strata_jax.engine.runner import ModelRunner, read_length
from strata_jax.loaded_model import LoadedModel

log = logging.getLogger("strata_jax.engine")


class Scheduler:
    """Runs the device loop. All public methods are thread-safe."""

    def __init__(self, model: LoadedModel, config: EngineConfig, runner: ModelRunner, placement: ExpertPlacement,
                 drafter: Drafter | None, output: OutputProcessor):
        self.model = model
        self.config = config
        self.runner = runner
        self.placement = placement
        self.drafter = drafter
        self.output = output
        tokenizer = model.tokenizer
        self.eos = set(model.config.eos_token_ids) | (set(tokenizer.eos_token_ids) if tokenizer else set())
        c = model.config.indexer_compress_ratio if model.config.qsa else 1
        self.prefix_cache = PrefixCache(config.prefix_cache_mib << 20, kv_block=c,
                                        device_budget_bytes=config.prefix_cache_device_mib << 20)
        self.policy = PrefillPolicy(config)
        self._pacing: EngineConfig | None = None  # a new policy's config, taken up by the engine thread (set_pacing)
        self._clear_prefix_cache = False  # clear_prefix_cache(): done by the engine thread before its next iteration
        self.snapshot_seconds = 0.0  # engine-thread time spent taking prefix snapshots
        self.kv_len = runner.cache.max_len
        self.counters = collections.Counter()
        self.calls = CallLog(config.call_log)  # what the engine thread ran, when (benchmarks' timelines)
        self.executor = StepExecutor(model, config, runner, placement, self.counters, self.calls)
        # Per-slot draft lengths from acceptance (strata_jax/engine/draft_policy.py); None: always draft_k.
        self.draft_lengths = DraftLengths(config.draft_ks) if config.adaptive_draft else None
        self._queue: collections.deque[Job] = collections.deque()
        self._slots: list[Job | None] = [None] * config.slots
        self._cancelled: set[str] = set()
        self._ended: dict[RequestStream, int | None] = {}  # stop-string ends: stream -> tokens it kept
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.busy_since: float | None = None  # when the iteration running now began (the watchdog reads it)
        self._abandoned: set[Job] = set()  # failed from outside while the engine thread was busy (watchdog, stop)
        # Overlapped steps need next-step inputs that live on the device: no PLE rows; decode with a drafter only
        # while every decoding slot's drafts are paused (adaptive lengths), verify windows with a drafter that
        # guesses on the device (`_overlap`).
        self._can_overlap = config.overlap_steps and not model.config.ple_layers
        self.chains = (self._can_overlap and config.chain_windows and isinstance(drafter, DeviceDrafter)
                        and runner.mesh_steps is None)
        if self.chains:
            drafter.bind(config.slots, config.max_context)

    # -- control -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.policy.warmed_up(self.runner.step_seconds)  # the prefill shape beside decoding slots
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    def stop(self, message: str = "the engine is shutting down", timeout: float = 2.0) -> None:
        """Ends every request at once with a retryable error event (`message`), then stops the engine thread,
        waiting at most `timeout` seconds for the step it may be running."""
        self.abandon(message)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def abandon(self, message: str) -> int:
        """Fails every queued and running request now, from any thread, with a retryable error event - even while
        the engine thread is stuck in a step. Their slots are freed when (if) that step returns. Returns how many
        requests were failed."""
        now = time.monotonic()
        with self._cond:
            jobs = [j for j in self._slots if j is not None and j not in self._abandoned] + list(self._queue)
            self._queue.clear()
            self._abandoned.update(j for j in jobs if j.slot >= 0)
            self._cond.notify_all()
        for job in jobs:
            self.output.put(job.output([], "error", now, error=message, retryable=True))
        return len(jobs)

    def add(self, job: Job) -> None:
        """Queues a job (its stream is open at the output processor)."""
        with self._cond:
            self._queue.append(job)
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(job.prompt)
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        """Ends the request (queued or running) with a "cancelled" event and frees its slot."""
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify_all()

    def set_pacing(self, config: EngineConfig) -> None:
        """Prefill beside decoding follows `config`'s decode_share, mixed_step_ms and mixed_prefill from the next
        iteration on (the compiled shapes stay; the choice among them changes)."""
        with self._cond:
            self._pacing = config
            self._cond.notify_all()

    def clear_prefix_cache(self) -> None:
        """Drops every prefix-cache snapshot before the engine's next iteration (before any request queued after
        this call is admitted)."""
        with self._cond:
            self._clear_prefix_cache = True
            self._cond.notify_all()

    def end(self, stream: RequestStream, kept: int | None) -> None:
        """Frees the slot of a request whose output already ended (a stop string matched after `kept` of its
        tokens; None: its output failed); no event is sent."""
        with self._cond:
            self._ended[stream] = kept
            self._cond.notify_all()

    def snapshot_stats(self) -> dict[str, float]:
        with self._cond:
            busy = sum(j is not None for j in self._slots)
            return {
                "requests_total": self.counters["requests"],
                "prompt_tokens_total": self.counters["prompt_tokens"],
                "generated_tokens_total": self.output.generated,
                "prefix_cache_hit_tokens_total": self.counters["cached_tokens"],
                **self.prefix_cache.stats(),  # snapshots, bytes, in flight, hits, misses, evictions
                "prefix_cache_snapshot_seconds_total": self.snapshot_seconds,
                "shared_prefix_waits_total": self.counters["shared_waits"],  # waited for another's snapshot
                "prefill_deferred_total": self.counters["prefill_deferred"],  # paced: decoders stepped alone
                "prefill_bursts_total": self.policy.bursts,  # short prompts prefilled at once beside decoders
                "mixed_prefill_width": self.policy.mixed[0],
                "mixed_prefill_prompts": self.policy.mixed[1],
                "slots_busy": busy,
                "slots_total": self.config.slots,
                "queue_length": len(self._queue),
                "decode_steps_total": self.counters["decode_steps"],
                "prefill_chunks_total": self.counters["prefill_chunks"],  # prompt pieces prefilled
                "prefill_calls_total": self.counters["prefill_calls"],  # steps that ran them (several per call)
                "cancelled_total": self.counters["cancelled"],
                "refilled_slots_total": self.counters["refilled"],  # slots refilled after another's failed step
                "draft_tokens_total": self.counters["drafted"],
                "accepted_draft_tokens_total": self.counters["accepted"],
                "verify_steps_total": self.counters["verify_steps"],
                "overlapped_steps_total": self.counters["overlapped_steps"],
                "chained_windows_total": self.counters["chained_windows"],  # verify windows launched on the device
                # Overlapped decoding's host time: launching steps (with the placement's work after each), and
                # waiting for the step before to finish. Little waiting means the host, not the device, sets the rate.
                "decode_launch_seconds_total": self.counters["launch_seconds"],
                "decode_read_back_seconds_total": self.counters["read_back_seconds"],
                # Steps run in step with the host (speculation, PLE, grammar masks, log-probabilities: no overlap):
                # their count, the runner calls' time (launch + device + read back) and the whole of each such
                # step on the engine thread (drafting and inputs before, acceptance and output after, included).
                "in_step_steps_total": self.counters["in_step_calls"],
                "in_step_call_seconds_total": self.counters["in_step_call_seconds"],
                "in_step_seconds_total": self.counters["in_step_seconds"],
                "max_decode_stall_seconds": self.executor.max_stall,
                **self.placement.stats(),  # host expert tier: GPU pool hit rate, promotions (if any)
            }

    # -- the loop ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._stop and not self._queue and not any(self._slots) and not self._cancelled
                       and not self._ended and not self._clear_prefix_cache):
                    self._cond.wait()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                ended, self._ended = self._ended, {}
                pacing, self._pacing = self._pacing, None
                if pacing is not None:
                    self.policy.reconfigure(pacing)
                if self._clear_prefix_cache:
                    self._clear_prefix_cache = False
                    self.prefix_cache.clear()
                self._drop_cancelled_queued(cancelled)
                self.busy_since = time.monotonic()
            try:
                self._release_abandoned()
                self._iteration(cancelled, ended)
            except Job.Failed as e:  # one request's inputs, or a step that ran it alone: it fails alone
                log.warning("request %s failed: %s", e.job.request.request_id, e)
                self._fail_job(e.job, f"request failed: {e}")
            except PrefillBatchFailed as e:  # one of these prompts is at fault: run each alone to find it
                log.warning("a prefill of %d prompts failed (%s): they go on one per call", len(e.jobs), e)
                for job in e.jobs:
                    job.prefill_alone = True
                if self.executor.state_lost():
                    self._lose_state()
            except Exception as e:  # a failed shared step must not take the other users down with the thread
                log.exception("engine step failed")
                self._fail_all(f"engine error: {e}")
            finally:
                self.busy_since = None
        self.abandon("the engine stopped")

    def _release_abandoned(self) -> None:
        """Frees the slots of requests failed from outside (their events went out already). The state of a step
        the watchdog gave up on is not trusted: a fresh cache, and the surviving requests refill theirs."""
        with self._cond:
            abandoned, self._abandoned = self._abandoned, set()
        if not abandoned:
            return
        for job in abandoned:
            self._free(job)
        self._lose_state()

    def _drop_cancelled_queued(self, cancelled: set[str]) -> None:
        for job in [j for j in self._queue if j.request.request_id in cancelled]:
            self._queue.remove(job)
            self.output.put(job.output([], "cancelled", time.monotonic()))

    def _iteration(self, cancelled: set[str], ended: dict[RequestStream, int | None]) -> None:
        """Decides this iteration's work: ends, admission, one prefill chunk, one step for the decoding slots."""
        if self.executor.in_flight is not None and (
            cancelled or ended or self._admission_pending() or self._overlap() != self.executor.in_flight.kind
        ):
            self._hand_out(self.executor.land())
        started = time.perf_counter()  # what is not the decode step below is charged to prefill's share
        for job in list(self._slots):
            if job is not None and job.request.request_id in cancelled:
                self._finish(job, "cancelled", snapshot=False)
                self.counters["cancelled"] += 1
            elif job is not None and job.stream in ended:
                kept = ended[job.stream]
                self._finish(job, None, snapshot=kept is not None, kept=kept)
        self.prefix_cache.poll()
        self._admit()
        self._end_waits()
        decode_s = 0.0
        decoders = any(j is not None and not j.prefilling for j in self._slots)
        prefilling = self.policy.order(
            [j for j in self._slots if j is not None and j.prefilling and j.waiting_for is None])
        burst = self.policy.burst(prefilling, decoders)
        if burst:
            self._prefill(*self._prefill_call(self._prefill_group(burst, len(burst)), self.config.chunk))
        elif prefilling and self.policy.may_prefill(decoders):
            limit, most = self.policy.shape(decoders, len(prefilling))
            self._prefill(*self._prefill_call(self._prefill_group(prefilling, most), limit))
        elif prefilling:
            self.counters["prefill_deferred"] += 1
        decoding = [j for j in self._slots if j is not None and not j.prefilling]
        overlap = self._overlap() if decoding else None
        if overlap is not None:
            step_started = time.perf_counter()  # launching waits for the step before: about one step's time
            if overlap == "verify":
                landed = self.executor.launch_window(decoding, self._window_wants(decoding), self.drafter)
            else:
                if self.drafter is not None:  # every slot's drafts are paused: this step counts down their pauses
                    for job in decoding:
                        self.draft_lengths.length(job.slot, job)
                landed = self.executor.launch(decoding)
            decode_s = time.perf_counter() - step_started
            if landed is not None:
                self._hand_out(landed)
            decoding = []
        elif decoding and self.executor.in_flight is not None:  # a decoder the step in flight lacks (its prompt
            # just ended): that step lands first, then this one runs in step with the host
            self._hand_out(self.executor.land())
            decoding = [j for j in self._slots if j is not None and not j.prefilling]
        if decoding:
            step_started = time.perf_counter()
            drafts = self._drafts(decoding)
            if any(drafts.values()):
                self._verify(decoding, drafts)
            else:
                self._decode(decoding)
            decode_s = time.perf_counter() - step_started
            self.counters["in_step_seconds"] += decode_s
        # Admission, restores, prefill and snapshots: time the decoding slots waited for.
        self.policy.prefilled(time.perf_counter() - started - decode_s, decoders)
        if decode_s:
            running = [j for j in self._slots if j is not None]
            waiting = sum(j.prefilling for j in running)
            self.policy.decoded(decode_s, waiting, decoders=len(running) - waiting)

    # -- admission -----------------------------------------------------------------------------------------------
    def _admission_pending(self) -> bool:
        with self._cond:
            return bool(self._queue) and any(j is None for j in self._slots)

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
            self._restore(job, fresh=True)
            self._share(job)

    def _restore(self, job: Job, fresh: bool) -> None:
        """Restores the longest cached prefix of the job's prompt into its slot if it is longer than what the slot
        holds (`fresh`: the slot holds nothing of it yet: reset it when nothing is cached)."""
        snap = self.prefix_cache.lookup(job.fill)
        if snap is not None and len(snap.tokens) > job.pos:
            with self.calls.timed("restore", slots=(job.slot,), tokens=len(snap.tokens)):
                self._write_snapshot(job.slot, snap)
            self.counters["cached_tokens"] += len(snap.tokens) - job.pos
            job.pos = job.cached = job.consumed = len(snap.tokens)
        elif fresh:
            self.runner.reset(job.slot)
        job.ple_ctx = self.model.ple_context(job.fill[: job.pos])

    def _write_snapshot(self, slot: int, snap) -> None:
        """Restores a snapshot into `slot`: its KV padded to the read bucket past the prefix (only that much
        crosses to the device; a whole 65,536-token slot of Flash-Next is 1.8 GB)."""
        self.runner.write(slot, self.prefix_cache.restore(snap, read_length(len(snap.tokens), self.kv_len)))

    def _share(self, job: Job) -> None:
        """Where the job's prompt parts from prompts seen before, a snapshot lets the next one like it resume there:
        from a cached conversation (its path in the prefix cache goes further than its last snapshot), the job
        snapshots the parting point itself; from a prompt prefilling now, the job waits for that one's snapshot
        at the parting point (a prefix common to several sessions is computed once)."""
        least = self.config.share_min_tokens
        if not least or self.prefix_cache.budget <= 0 or job.refilling:
            return
        _, matched = self.prefix_cache.match(job.fill)
        if job.pos < matched < len(job.fill) and matched >= least:
            job.snapshot_at.add(matched)
        best, at = None, 0
        for other in self._slots:
            if other is None or other is job or other.waiting_for is not None or not other.prefilling:
                continue
            n = min(shared_length(job.fill, other.fill), len(job.fill) - 1)
            if n > at and n >= least and other.pos < n and n - job.pos >= least:
                best, at = other, n
        if best is not None:
            best.snapshot_at.add(at)
            job.waiting_for, job.wait_until = best, at
            self.counters["shared_waits"] += 1

    def _end_waits(self) -> None:
        """Jobs waiting for another's snapshot go on when it is taken (or will not be: that one left its slot)."""
        for job in self._slots:
            other = job.waiting_for if job is not None else None
            if other is None:
                continue
            gone = not (0 <= other.slot < len(self._slots) and self._slots[other.slot] is other)
            if gone or other.pos >= job.wait_until:
                job.waiting_for = None
                self._restore(job, fresh=False)

    # -- which step ----------------------------------------------------------------------------------------------
    def _overlap(self) -> str | None:
        """Which step the decoding requests take overlapped with the host: "decode", "verify" (chained windows), or
        None (in step with the host). Some request decodes, none needs the host in step, and (with a step in flight)
        every decoding one ran in it: the next step's inputs are the in-flight step's outputs, still on the device.
        Prompts may prefill meanwhile: their calls queue on the device behind the step in flight, and steps between
        them overlap as without them."""
        if not self._can_overlap:
            return None
        running = [j for j in self._slots if j is not None]
        decoding = [j for j in running if not j.prefilling]
        if not decoding:
            return None
        if any(j.host_bound for j in running):  # a grammar mask or log-probabilities: the host steps along
            return None
        in_flight = self.executor.in_flight
        if in_flight is not None and not all(j in in_flight.jobs for j in decoding):
            return None
        if self.drafter is None or (self.draft_lengths is not None
                                    and all(self.draft_lengths.paused(j.slot, j) for j in decoding)):
            return "decode"
        if not self.chains:
            return None  # a slot drafts this step: its drafts need the in-flight step's tokens on the host
        # Two windows (the one in flight and the next) must not run past a request's length limits: near them the
        # windows run in step with the host, which cuts the drafts to what may still be emitted.
        most = 2 * max(self.config.verify_widths)
        if any(self._draft_limit(j) < most for j in decoding):
            return None
        if in_flight is None and not any([self.drafter.device_ready(j.slot, j, j.prompt + tuple(j.generated))
                                          for j in decoding]):
            return None  # the drafter has nothing to guess for any of them on the device
        return "verify"

    def _window_wants(self, jobs: list[Job]) -> dict[int, int]:
        """Each job's draft length for its next chained window (adaptive: from its acceptance, one window late;
        0 while paused), at least one slot drafting."""
        if self.draft_lengths is None:
            return {job.slot: self.config.draft_k for job in jobs}
        want = {job.slot: self.draft_lengths.length(job.slot, job) for job in jobs}
        return want if any(want.values()) else {job.slot: min(self.config.draft_ks) for job in jobs}

    def _drafts(self, jobs: list[Job]) -> dict[int, list[int]]:
        """The drafter's guesses for every decoding job, each at most its slot's draft length (adaptive: from its
        acceptance, 0 while paused; else draft_k), cut to what a compiled verify window holds."""
        if self.drafter is None:
            return {}
        requests = {}
        for job in jobs:
            k = self.config.draft_k if self.draft_lengths is None else self.draft_lengths.length(job.slot, job)
            if k <= 0:
                continue
            requests[job.slot] = DraftRequest(job, job.prompt + tuple(job.generated),
                                              min(k, self._draft_limit(job)), tuple(job.device_drafts))
        if not requests:
            return {}
        proposed = self.drafter.propose(requests)
        return {slot: list(d)[: max(requests[slot].limit, 0)] for slot, d in proposed.items() if slot in requests}

    def _draft_limit(self, job: Job) -> int:
        """Drafts that can still be emitted: the verify window also emits one token of the target's own."""
        return min(
            job.request.sampling.max_tokens - len(job.generated) - 1,
            self.config.max_context - len(job.prompt) - len(job.generated) - 1,
        )

    # -- steps and their results ---------------------------------------------------------------------------------
    def _prefill_group(self, prefilling: Sequence[Job], most: int) -> list[Job]:
        """The jobs whose next prompt pieces run in this iteration's prefill call: the first in the policy's order
        and the next ones in that order (up to `most`, in a compiled power-of-two count), whatever their pieces'
        widths: the call takes the widest piece among them (`StepExecutor.prefill`), the others padded. Grouping only
        pieces of one width left a prompt whose rest was shorter than the others' to run alone: of four agents'
        first turns arriving together, the one with the shortest tail finished first in a narrow call, the other
        three then prefilled beside a decoder, one at a time."""
        first = prefilling[0]
        if most == 1 or first.prefill_alone:
            return [first]
        group = [first] + [j for j in prefilling[1:] if not j.prefill_alone]
        return group[: max(b for b in self.config.prefill_batches if b <= min(len(group), most))]

    def _prefill_call(self, group: list[Job], limit: int) -> tuple[list[Job], int]:
        """(the first jobs of `group`, the widest piece) of this iteration's prefill call: of the compiled widths up
        to `limit` and the prompt counts up to `group`'s, the shape that moves the most prompt tokens per second
        (`PrefillPolicy.fastest`); the whole group at `limit` before warm-up has timed the shapes."""
        pieces = {w: [self.executor.piece_length(job, w) for job in group]
                  for w in self.config.prefill_chunks if w <= limit}
        best = self.policy.fastest(pieces, len(group))
        if best is None:
            return group, limit
        width, prompts = best
        return group[:prompts], width

    def _prefill(self, jobs: list[Job], limit: int | None = None) -> None:
        every = self.config.snapshot_every
        started = {job.slot: job.pos for job in jobs}
        tokens = self.executor.prefill(jobs, limit)
        snapshots = []
        for job in jobs:
            token = tokens[job.slot]
            # The end of a long prompt too: an agent's next turn re-sends it (its answer re-rendered by the chat
            # template rarely matches the tokens generated, so the end-of-turn snapshot seldom serves it).
            prompt_end = token is not None and job.pos >= every
            # Pieces need not end on multiples of `every`: a snapshot after each piece that passes one.
            passed = job.pos // every > started[job.slot] // every
            if passed or job.pos in job.snapshot_at or prompt_end:
                snapshots.append((job, job.fill[: job.pos]))
            if token is not None and job.refilling:  # a refill after lost state: its next token is known already
                job.refilling = False
            elif token is not None:
                job.first_token = time.monotonic()
                self._log_first_token(job)
                self._accept(job, [token])
            if token is None:
                self._log_progress(job)
        # After the first tokens are out: a snapshot costs the engine thread milliseconds that no first token
        # should wait for. A job its first token finished keeps its state in the slot until the next admission.
        for job, prefix in snapshots:
            self._snapshot(job, prefix)

    def _long(self, job: Job) -> bool:
        return len(job.fill) >= self.config.progress_min_tokens and log.isEnabledFor(logging.INFO)

    def _log_progress(self, job: Job) -> None:
        """A long prompt's prefill is never silent: tokens in the cache and the prompt rate, at most every
        `progress_every_s` seconds."""
        now = time.monotonic()
        if not self._long(job) or now - max(job.admitted, job.progress_at) < self.config.progress_every_s:
            return
        job.progress_at = now
        total, took = len(job.fill), now - job.admitted
        log.info("prefill %s: %d/%d prompt tokens (%.0f%%) in %.1fs, %.0f prompt tok/s", job.request.request_id,
                 job.pos, total, 100.0 * job.pos / total, took, (job.pos - job.cached) / max(took, 1e-9))

    def _log_first_token(self, job: Job) -> None:
        if not self._long(job):
            return
        took = job.first_token - job.admitted
        log.info("first token %s: TTFT %.2fs (%.2fs queued), %d prompt tokens (%d cached) at %.0f prompt tok/s",
                 job.request.request_id, job.first_token - job.submitted, job.admitted - job.submitted,
                 len(job.prompt), job.cached, (len(job.prompt) - job.cached) / max(took, 1e-9))

    def _decode(self, jobs: list[Job]) -> None:
        tokens = self.executor.decode(jobs)
        for job in jobs:
            self._accept(job, [tokens[job.slot]])
        if not any(j is not None and not j.prefilling for j in self._slots):
            self.executor.idle()

    def _verify(self, jobs: list[Job], drafts: dict[int, list[int]]) -> None:
        emitted = self.executor.verify(jobs, drafts)
        for job in jobs:
            self._count_drafts(job, len(drafts.get(job.slot, [])), len(emitted[job.slot]) - 1)
            self._accept(job, emitted[job.slot])

    def _count_drafts(self, job: Job, proposed: int, accepted: int) -> None:
        job.drafted += proposed
        job.accepted += accepted
        if self.draft_lengths is not None:
            self.draft_lengths.update(job.slot, proposed, accepted)
        self.counters["drafted"] += proposed
        self.counters["accepted"] += accepted

    def _hand_out(self, landed: Landed) -> None:
        """The tokens of an overlapped step (a decode step or a chained verify window), read back."""
        for job in landed.jobs:
            if self._slots[job.slot] is not job:  # it finished at the step before: these tokens are discarded
                continue
            emitted = landed.emitted(job.slot)
            if landed.accepted is not None:
                proposed, accepted = int(landed.proposed[job.slot]), len(emitted) - 1
                self._count_drafts(job, proposed, accepted)
                self.drafter.observe(job.slot, job, landed.starts[job.slot], emitted, proposed, accepted)
            self._accept(job, emitted)
        if not any(j is not None and not j.prefilling for j in self._slots):
            self.executor.idle()

    def _accept(self, job: Job, tokens: list[int]) -> None:
        """Takes a step's new tokens of `job` up to the first that ends it (EOS / stop token, length), passes them
        to the output processor and finishes the job if one did."""
        at = time.monotonic()
        sampling = job.request.sampling
        reason: FinishReason | None = None
        n = 0
        for token in tokens:
            n += 1
            job.generated.append(token)
            job.last_token = token
            if (token in self.eos and not sampling.ignore_eos) or token in sampling.stop_token_ids:
                reason = "stop"
            elif (len(job.generated) >= sampling.max_tokens
                  or len(job.prompt) + len(job.generated) >= self.config.max_context):
                reason = "length"
            if reason is not None:
                break
        if job.matcher is not None and not job.matcher.advance(tokens[:n]):
            log.warning("request %s: the grammar refused a token (%s); its output goes on unconstrained",
                        job.request.request_id, job.matcher.failed)
            job.matcher = None
        if reason is not None:
            self._finish(job, reason, snapshot=True, tokens=tokens[:n], at=at)
        else:
            self.output.put(job.output(tokens, None, at))

    def _finish(self, job: Job, reason: FinishReason | None, snapshot: bool, kept: int | None = None,
                tokens: list[int] | None = None, at: float | None = None) -> None:
        """Frees the job's slot, sends its last output (none for `reason` None: its output already ended after
        `kept` tokens), then snapshots the slot's state for the prefix cache."""
        # The state holds the first `consumed` tokens of the sequence: every generated token but the last (not fed
        # back yet), or all of them when an overlapped step or an accepted draft run fed the last one too. A stop
        # inside an accepted draft run leaves it past the sequence: then it is not a snapshot of any known prefix.
        # A chained window in flight has run it further still.
        seq = job.prompt + tuple(job.generated[:kept] if kept is not None else job.generated)
        fed = len(seq) - 1 <= job.consumed <= len(seq) and not (
            self.executor.in_flight is not None and self.executor.in_flight.kind == "verify"
            and self.executor.carries(job))
        keep = snapshot and len(seq) > len(job.prompt) and not job.prefilling and fed
        if reason == "cancelled":  # its snapshots still in flight are dropped: their device copies freed now
            self.prefix_cache.drop_pending(job.request.request_id)
        self._free(job)
        if reason is not None:
            self.output.put(job.output(tokens or [], reason, time.monotonic() if at is None else at))
        if keep:  # after the last output (milliseconds of the engine thread); the slot's state stays until the
            # next admission, which comes in a later iteration
            self._snapshot(job, seq[: job.consumed])

    def _snapshot(self, job: Job, tokens: Sequence[int]) -> None:
        """Snapshots the job's slot after `tokens` (all of its state) for the prefix cache, without waiting for
        the copy: queued on the device behind the step that filled the slot, copied to the host asynchronously."""
        if not self._keeps(len(tokens)) or tokens in self.prefix_cache:
            return
        started = time.perf_counter()
        with self.calls.timed("snapshot", slots=(job.slot,), tokens=len(tokens)):
            state = self.runner.read_on_device(job.slot, len(tokens))
            self.prefix_cache.insert_async(tokens, state, owner=job.request.request_id)
        self.snapshot_seconds += time.perf_counter() - started

    def _keeps(self, positions: int) -> bool:
        """Whether the prefix cache would store a snapshot of `positions` tokens (else the read is skipped)."""
        return self.prefix_cache.would_keep(positions, self.runner.snapshot_bytes(positions))

    def _free(self, job: Job) -> None:
        with self._cond:
            if 0 <= job.slot < len(self._slots) and self._slots[job.slot] is job:
                self._slots[job.slot] = None

    def _fail_job(self, job: Job, message: str) -> None:
        """Fails one request; if the failed call consumed the slot cache, the others refill their state."""
        self._free(job)
        self.output.put(job.output([], "error", time.monotonic(), error=message))
        if self.executor.state_lost():
            self._lose_state()

    def _lose_state(self) -> None:
        """A fresh slot cache (and nothing in flight). Every running request refills its slot with what it has
        consumed so far (its prompt and generated tokens, the prefix cache helping) and goes on exactly where it
        was: its output is the same as if nothing had happened."""
        self.executor.recover()  # a step in flight is dropped: its tokens are computed again
        for job in [j for j in self._slots if j is not None]:
            job.refilling = bool(job.generated)
            job.pos = job.consumed = 0
            job.device_drafts = []
            snap = self.prefix_cache.lookup(job.fill)
            if snap is not None:
                self._write_snapshot(job.slot, snap)
                job.pos = job.consumed = len(snap.tokens)
            job.ple_ctx = self.model.ple_context(job.fill[: job.pos])
            self.counters["refilled"] += 1

    def _fail_all(self, message: str) -> None:
        """After a shared step failed (no single request to blame): fails the running requests (queued ones wait)
        and rebuilds the slot cache, whose buffers the failed donated call may have consumed."""
        for job in [j for j in self._slots if j is not None]:
            self.output.put(job.output([], "error", time.monotonic(), error=message))
            self._free(job)
        self.executor.recover()

