"""One generation request on the engine, as seen by an HTTP handler.

`EngineRun` submits the request (before the response starts, so a context overflow is still a 400), yields its
`TokenEvent`s (and `None` heartbeats while nothing arrives, for SSE pings), watches the client connection, records
metrics, and always releases the engine slot: when the handler stops early, raises, is cancelled, or the client
disconnects, the request is cancelled in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from strata_jax.engine.protocol import EngineProtocol, EngineUnavailable, GenerationRequest, PromptTooLong, TokenEvent

from server.errors import ApiError, invalid_request
from server.metrics import ServerMetrics

log = logging.getLogger("strata.server")

# How often a waiting handler checks whether its client is still connected.
_POLL_S = 0.5


class ClientGone(Exception):
    """The HTTP client closed the connection."""


def generation_failed(event: TokenEvent) -> ApiError:
    """The error for an engine event that ended a request with "error": 503 (overloaded: retry) when the cause is
    the engine's state (shutting down, a stuck step), else 500."""
    if event.retryable:
        return ApiError(503, event.error or "the engine is unavailable; retry shortly", headers={"retry-after": "5"})
    return ApiError(500, f"generation failed: {event.error or 'engine error'}")


def client_connected(request: web.Request) -> bool:
    """False once the client's connection is closed (aiohttp drops the transport on connection loss)."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


class EngineRun:
    """`async with EngineRun(...) as run: async for event in run.events(): ...` - see the module docstring."""

    def __init__(self, engine: EngineProtocol, gen: GenerationRequest, http: web.Request, metrics: ServerMetrics,
                 *, heartbeat_s: float) -> None:
        """Prepare to run `gen` on `engine` for the HTTP request `http`."""
        self._engine = engine
        self.gen = gen
        self._http = http
        self._metrics = metrics
        self._heartbeat_s = heartbeat_s
        self._stream: Any = None
        self._pending: asyncio.Future | None = None
        self.finished = False
        self.first_event: TokenEvent | None = None
        self.last_event: TokenEvent | None = None
        self.generated = 0
        self._started = 0.0
        self._first_token_at: float | None = None

    async def __aenter__(self) -> EngineRun:
        self._started = time.monotonic()
        try:
            self._stream = await self._engine.submit(self.gen)
        except PromptTooLong as exc:
            raise invalid_request(str(exc)) from exc
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc), headers={"retry-after": "5"}) from exc
        except ValueError as exc:
            raise invalid_request(f"the engine rejected the request: {exc}") from exc
        self._metrics.in_flight.inc()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._metrics.in_flight.dec()
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
            with contextlib.suppress(BaseException):
                await self._pending
        if not self.finished:
            log.info("request %s ended early (client gone or error) after %d tokens: cancelled in the engine",
                     self.gen.request_id, self.generated)
            self._engine.cancel(self.gen.request_id)
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    async def events(self) -> AsyncIterator[TokenEvent | None]:
        """The request's events; `None` after `heartbeat_s` without one. Raises ClientGone on disconnect."""
        stream = self._stream.__aiter__()
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        while not self.finished:
            if self._pending is None:
                self._pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({self._pending}, timeout=_POLL_S)
            if not done:
                if not client_connected(self._http):
                    raise ClientGone()
                if loop.time() - last_sent >= self._heartbeat_s:
                    last_sent = loop.time()
                    yield None
                continue
            task, self._pending = self._pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                raise ApiError(500, "the engine ended the stream without a finish reason") from None
            last_sent = loop.time()
            self._record(event)
            yield event

    def _record(self, event: TokenEvent) -> None:
        now = time.monotonic()
        if self.first_event is None:
            self.first_event = event
            self._metrics.prompt_tokens.inc(event.prompt_tokens or len(self.gen.prompt_ids))
            self._metrics.cache_hit_tokens.inc(event.cached_tokens)
        if event.token_id is not None:
            self.generated += 1
            if self._first_token_at is None:
                self._first_token_at = now
                self._metrics.ttft.observe(now - self._started)
        if event.finish_reason is not None:
            self.finished = True
            self.last_event = event
            self._metrics.completion_tokens.inc(self.completion_tokens)
            speed = event.timing.decode_tokens_per_s if event.timing else 0.0
            if not speed and self._first_token_at is not None and self.generated > 1:
                speed = (self.generated - 1) / max(now - self._first_token_at, 1e-9)
            if speed:
                self._metrics.decode_speed.observe(speed)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far (the engine's count when it reports one)."""
        reported = self.last_event.completion_tokens if self.last_event else 0
        return max(reported, self.generated)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied (known after the first event)."""
        return self.first_event.cached_tokens if self.first_event else 0
