"""`Engine`: the async front of the serving loop. `submit()` queues a request and returns an async stream of
`TokenEvent`s. Three threads carry a request: the caller's event loop (submit, the stream), the engine thread (the
scheduler deciding, the model runner executing) and the output thread (detokenization, stop strings, events)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import numbers
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator

from strata_jax.loaded_model import LoadedModel
from strata_jax.engine.protocol import EngineUnavailable, GenerationRequest, PromptTooLong, TokenEvent
from strata_jax.engine.call_log import Call
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.drafters import Drafter, make_drafter
from strata_jax.engine.job import Job
from strata_jax.engine.output import OutputProcessor
from strata_jax.engine.placement import ExpertPlacement, PlacementConfig
from strata_jax.engine.planner import device_memory, snapshot_pool_bytes
from strata_jax.engine.scheduler import Scheduler
from strata_jax.engine.runner import ModelRunner, RunnerModel
from strata_jax.model.cache import cache_bytes

log = logging.getLogger("strata_jax.engine")


class Engine:
    """Serves one loaded model to many concurrent requests (implements `EngineProtocol`)."""

    def __init__(
        self, model: LoadedModel, config: EngineConfig | None = None, drafter: Drafter | None = None,
        placement: PlacementConfig | None = None,
    ):
        """`drafter` (a `Drafter`, strata_jax/engine/drafters.py) overrides the one `config.draft` names; the
        verify step is compiled when there is one. `placement`: hot-expert placement policy for a model with a host
        expert tier (default: `PlacementConfig()`)."""
        self.model = model
        self.config = config or EngineConfig()
        self.tokenizer = model.tokenizer
        self.context_length = self.config.max_context
        self.placement = ExpertPlacement(model.state, model.graphdef, placement)
        self.placement.warm_up()
        self._drafter = drafter if drafter is not None else make_drafter(self.config)
        tier = self.placement
        self._runner = ModelRunner(RunnerModel.of(model), self.config, with_verify=self._drafter is not None,
                                   counters_lock=tier.lock, weights_version=lambda: tier.writes)
        mib = cache_bytes(self._runner.cache) / 2**20
        print(
            f"engine: {self.config.slots} slots x {self.config.max_context} tokens, caches {mib:.1f} MiB on device",
            file=sys.stderr,
            flush=True,
        )
        self._output = OutputProcessor(model.tokenizer, lambda stream, kept: self._scheduler.end(stream, kept))
        self._scheduler = Scheduler(model, self.config, self._runner, self.placement, self._drafter, self._output)
        self.compile_seconds = 0.0
        self._started = False
        self._unavailable = ""  # why submit() refuses requests now ("" = it takes them)
        self._closing = threading.Event()
        self.watchdog_trips = 0
        self._constraints = None  # constraints.ConstraintCompiler, built at start (or by the first constrained request)

    def start(self) -> None:
        """Compiles every step (warm-up, with progress lines) and starts the engine and output threads."""
        if self._started:
            return
        host_seconds = self._warm_up_host_tier()
        # The warm-up's real runs are steps like any other: the scheduler hands their routing counts on.
        step_seconds = self._runner.warm_up(after_step=self._scheduler.executor.after_step)
        self.compile_seconds = host_seconds + step_seconds
        if self._drafter is not None:
            self._drafter.warm_up()
        if self._scheduler.chains:  # the small jitted function that builds each chained window on the device
            self._runner.warm_up_windows(self._drafter)
        if self.tokenizer is not None:
            # llguidance's view of the vocabulary takes 2-3.5 s at 248,320 tokens: built here, not by the first
            # constrained request (every agent request offers tools) while the server's event loop waits.
            try:
                self._constraint_compiler()
            except Exception as exc:  # noqa: BLE001 - the engine serves without; constrained requests get the error
                print(f"constrained decoding unavailable: {exc}", file=sys.stderr, flush=True)
        self._fit_snapshot_pool()
        self._output.start()
        self._scheduler.start()
        width, prompts = self._scheduler.policy.mixed
        why = ("as configured" if self.config.mixed_prefill is not None
               else f"calls of <= {self.config.mixed_step_ms:g} ms at warm-up")
        share = f"at most {1 - self.config.decode_share:.0%}" if self.config.decode_share > 0 else "all"
        if self.config.share_by_requests and self.config.decode_share > 0:
            share += " (or, if larger, the prompts' part of the requests in slots)"
        pieces = f"{width} tokens x {prompts} prompt{'s' if prompts != 1 else ''}"
        burst = (f"; a prompt whose rest fits {self.config.prefill_burst_ms:g} ms at full width prefills at once"
                 if self.config.prefill_burst_ms > 0 and self.config.decode_share > 0 else "")
        print(f"engine: beside decoding slots, prompts prefill in pieces of up to {pieces} ({why}) in {share} of the "
              f"engine's time{burst}", file=sys.stderr, flush=True)
        self._started = True
        if self.config.watchdog_s > 0:
            threading.Thread(target=self._watch, name="strata-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Trips when an iteration runs past `watchdog_s`: fails every request (their streams get a retryable
        error at once) and reports unhealthy until the engine thread comes back from the step."""
        limit = self.config.watchdog_s
        tripped = False
        while not self._closing.wait(min(1.0, limit / 4)):
            since = self._scheduler.busy_since
            stuck = since is not None and time.monotonic() - since > limit
            if stuck and not tripped:
                tripped = True
                self.watchdog_trips += 1
                self._unavailable = (f"an engine step has run for more than {limit:g}s (stuck); requests are "
                                     "failed until it returns")
                failed = self._scheduler.abandon(f"the engine is stuck (a step ran past {limit:g}s); retry later")
                log.error("watchdog: %s; %d request(s) failed", self._unavailable, failed)
                print(f"watchdog: {self._unavailable}; {failed} request(s) failed", file=sys.stderr, flush=True)
            elif tripped and not stuck:
                tripped = False
                self._unavailable = ""
                log.warning("watchdog: the stuck step returned; the engine takes requests again")
                print("watchdog: the stuck step returned; the engine takes requests again", file=sys.stderr,
                      flush=True)

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): unhealthy while the watchdog sees a stuck step, or once shutting down."""
        if not self._started:
            return False, "the engine is not started"
        return (not self._unavailable), self._unavailable

    def _fit_snapshot_pool(self) -> None:
        """Cuts the prefix cache's device pool to what the device has beside the largest compiled step, measured
        now that every step is compiled and the persistent arrays are allocated (`snapshot_pool_bytes`)."""
        cache = self._scheduler.prefix_cache
        if cache.device_budget <= 0:
            return
        fits, why = snapshot_pool_bytes(cache.device_budget, device_memory(), self._runner.largest_workspace_bytes())
        if why is not None:
            cache.device_budget = fits
            print(f"engine: {why}", file=sys.stderr, flush=True)

    def _warm_up_host_tier(self) -> float:
        """Compiles the host experts' shapes (up to every row a step can route to one expert); returns seconds."""
        if not self.placement.active:
            return 0.0
        t0 = time.monotonic()
        rows_max = max(self.config.slots * (self.config.draft_k + 1), *self.config.prefill_chunks)
        self.placement.layers[0].module.host.warm_up(rows_max)
        print(f"warm-up: host expert kernels (up to {rows_max} rows per expert) ready in "
              f"{time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
        return time.monotonic() - t0

    def shutdown(self, message: str = "the server is shutting down; retry shortly", timeout: float = 2.0) -> None:
        """Refuses new requests, ends every queued and running one at once with a retryable error event
        (`message`), stops the engine thread (waiting at most `timeout` s for a step it is running) and the
        output thread (after it delivered those events)."""
        self._unavailable = message
        self._closing.set()
        self._scheduler.stop(message, timeout=timeout)
        self._output.stop()

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queues `request`; returns its event stream. Raises PromptTooLong / ValueError for requests that cannot
        run. Closing the stream early (client gone) cancels the request and frees its slot."""
        if not self._started:
            raise RuntimeError("engine not started")
        if self._unavailable:
            raise EngineUnavailable(self._unavailable)
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.context_length:
            raise PromptTooLong(n, self.context_length - 1)
        vocab = self.model.config.vocab_size
        sampling = request.sampling.checked(vocab)
        ids = request.prompt_ids
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        request = GenerationRequest(request.prompt_ids, sampling, request.request_id or uuid.uuid4().hex)
        matcher = self._matcher(sampling.constraint) if sampling.constraint is not None else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(31)
        request_id = request.request_id

        def emit(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the caller's event loop is gone: nobody is listening any more
                if event.finish_reason is None:
                    self.cancel(request_id)

        submitted = time.monotonic()
        stream = self._output.open(request, emit, submitted)
        self._scheduler.add(Job(request=request, stream=stream, seed=int(seed) & 0x7FFFFFFF, submitted=submitted,
                                matcher=matcher))
        return self._stream(request.request_id, queue)

    def _matcher(self, constraint):
        """A grammar matcher for a constrained request (strata_jax/engine/constraints.py); ValueError when the model
        has no tokenizer or the constraint does not compile."""
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer")
        return self._constraint_compiler().matcher(constraint)

    def _constraint_compiler(self):
        """The grammar compiler over this model's vocabulary, built once."""
        if self._constraints is None:
            from strata_jax.engine.constraints import ConstraintCompiler

            eos = set(self.model.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
            self._constraints = ConstraintCompiler(self.tokenizer, self.model.config.vocab_size, eos)
        return self._constraints

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while True:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        self._scheduler.cancel(request_id)

    def set_prefill_pacing(self, decode_share: float | None = None, mixed_step_ms: float | None = None,
                           prefill_burst_ms: float | None = None, share_by_requests: bool | None = None) -> None:
        """Changes how prompts prefill beside decoding slots (`EngineConfig.decode_share`, `mixed_step_ms`,
        `prefill_burst_ms`, `share_by_requests`; None keeps the current value) without compiling anything: the
        warm-up's shapes stay, the choice among them and the share of time change from the engine's next iteration
        on. ValueError for values EngineConfig refuses."""
        changes = {k: v for k, v in (("decode_share", decode_share), ("mixed_step_ms", mixed_step_ms),
                                     ("prefill_burst_ms", prefill_burst_ms), ("share_by_requests", share_by_requests))
                   if v is not None}
        self.config = dataclasses.replace(self.config, **changes)
        self._scheduler.set_pacing(self.config)

    def clear_prefix_cache(self) -> None:
        """Drops every prefix-cache snapshot (host and device pool) before any request submitted after this call
        is admitted, e.g. between benchmark runs that must not share or evict each other's snapshots. Requests
        running now keep their slots; later turns of theirs prefill their whole prompt again."""
        self._scheduler.clear_prefix_cache()

    def compiled_hlo(self) -> dict[str, str]:
        """Each compiled step's HLO text by its warm-up name (`ModelRunner.compiled_hlo`), for profiles."""
        return self._runner.compiled_hlo()

    def calls(self, since: float = float("-inf")) -> list[Call]:
        """The engine thread's calls that started at or after `since` (`time.perf_counter()`), oldest first: kept
        only with `EngineConfig.call_log` > 0 (the last that many), else none."""
        return self._scheduler.calls.calls(since)

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics (see `EngineProtocol.stats`), with the watchdog's."""
        healthy, _ = self.health()
        return {**self._scheduler.snapshot_stats(), "engine_healthy": int(healthy),
                "watchdog_trips_total": self.watchdog_trips}
