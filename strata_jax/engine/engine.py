"""`Engine`: the async front of the serving loop. `submit()` queues a request and returns an async stream of
`TokenEvent`s; the JAX work runs in the scheduler thread and events come back through the caller's event loop."""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator

from strata_jax.loaded_model import LoadedModel
from strata_jax.engine.protocol import GenerationRequest, PromptTooLong, TokenEvent
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.placement import PlacementConfig
from strata_jax.engine.scheduler import Job, Scheduler
from strata_jax.engine.runner import DeviceSteps
from strata_jax.model.cache import cache_bytes


class Engine:
    """Serves one loaded model to many concurrent requests (implements `EngineProtocol`)."""

    def __init__(
        self, model: LoadedModel, config: EngineConfig | None = None, drafter=None,
        placement: PlacementConfig | None = None,
    ):
        """`drafter` (an object with `propose(history, limit) -> list[int]`) overrides `config.draft`; the
        verify step is compiled when either is set. `placement`: hot-expert placement policy for a model with a
        host expert tier (default: `PlacementConfig()`)."""
        self.model = model
        self.config = config or EngineConfig()
        self.tokenizer = model.tokenizer
        self.context_length = self.config.max_context
        self._steps = DeviceSteps(model, self.config, with_verify=drafter is not None or self.config.draft != "none",
                                  placement=placement)
        mib = cache_bytes(self._steps.cache) / 2**20
        print(
            f"engine: {self.config.slots} slots x {self.config.max_context} tokens, caches {mib:.1f} MiB on device",
            file=sys.stderr,
            flush=True,
        )
        self._drafter = drafter
        self._scheduler = Scheduler(model, self.config, self._steps, drafter)
        self.compile_seconds = 0.0
        self._started = False

    def start(self) -> None:
        """Compiles every step (warm-up, with progress lines) and starts the engine thread."""
        if self._started:
            return
        self.compile_seconds = self._steps.warm_up()
        if hasattr(self._drafter, "warm_up"):
            self._drafter.warm_up()
        self._scheduler.start()
        self._started = True

    def shutdown(self) -> None:
        self._scheduler.stop()

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queues `request`; returns its event stream. Raises PromptTooLong / ValueError for requests that cannot
        run. Closing the stream early (client gone) cancels the request and frees its slot."""
        if not self._started:
            raise RuntimeError("engine not started")
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.context_length:
            raise PromptTooLong(n, self.context_length - 1)
        if request.sampling.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not request.request_id:
            request = GenerationRequest(request.prompt_ids, request.sampling, uuid.uuid4().hex)
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

        job = Job(
            request=request,
            emit=emit,
            seed=int(seed) & 0x7FFFFFFF,
            submitted=time.monotonic(),
        )
        self._scheduler.add(job)
        return self._stream(request.request_id, queue)

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

    def stats(self) -> dict[str, float]:
        return self._scheduler.snapshot_stats()
