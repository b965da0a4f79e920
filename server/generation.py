"""One generation request on the engine, as seen by an HTTP handler.

`EngineRun` submits the request (before the response starts, so a context overflow is still a 400), yields its
`TokenEvent`s (and `None` heartbeats while nothing arrives, for SSE pings), watches the client connection, records
metrics, and always releases the engine slot: when the handler stops early, raises, is cancelled, or the client
disconnects, the request is cancelled in the engine. It also feeds the live monitor (`server.monitor`) and logs
the request's line at its end (`server.logs`).
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
from server.logs import LOGGED, log_request
from server.metrics import ServerMetrics
from server.monitor import Finished, Monitor, rate, token_times

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
                 *, heartbeat_s: float, api: str = "", monitor: Monitor | None = None) -> None:
        """Prepare to run `gen` on `engine` for the HTTP request `http`; `api` names the API in the request's log
        line, `monitor` (if any) shows the request while it runs."""
        self._engine = engine
        self.gen = gen
        self._http = http
        self._metrics = metrics
        self._heartbeat_s = heartbeat_s
        self.api = api
        self._monitor = monitor
        self.stop_reason: str | None = None  # the API's own stop reason, set by the handler when it knows it
        self._token_times = token_times()
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
        if self._monitor is not None:
            self._monitor.begin(self.gen.request_id, self)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._metrics.in_flight.dec()
        ended = self.finished_summary(exc_info[0])
        try:
            if self._pending is not None and not self._pending.done():
                self._pending.cancel()
                with contextlib.suppress(BaseException):
                    await self._pending
            if not self.finished:  # the request's log line says so ("cancelled ...")
                self._engine.cancel(self.gen.request_id)
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        finally:
            if self._monitor is not None:
                self._monitor.end(self.gen.request_id, ended)
            log_request(ended)
            self._http[LOGGED] = True

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
            self._token_times.append(now)
            if self._monitor is not None:
                self._monitor.token(now)
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

    def decode_tok_s(self, now: float | None = None) -> float | None:
        """Decode speed after the first token: the engine's figure once it reports one, else measured here (None
        before a second token)."""
        timing = self.last_event.timing if self.last_event else None
        if timing is not None and timing.decode_tokens_per_s:
            return timing.decode_tokens_per_s
        if self._first_token_at is None or self.generated < 2:
            return None
        end = now if now is not None and not self.finished else self._last_token_at
        return (self.generated - 1) / max(end - self._first_token_at, 1e-9)

    @property
    def _last_token_at(self) -> float:
        return self._token_times[-1] if self._token_times else time.monotonic()

    @property
    def ttft_s(self) -> float | None:
        """Seconds from submission to the first token (None before it)."""
        return None if self._first_token_at is None else self._first_token_at - self._started

    def snapshot(self, now: float) -> dict[str, Any]:
        """The request as the live monitor shows it."""
        first = self.first_event
        return {
            "id": self.gen.request_id,
            "api": self.api,
            "state": "waiting" if self._first_token_at is None else "generating",
            "age_s": round(now - self._started, 2),
            "prompt_tokens": (first.prompt_tokens if first and first.prompt_tokens else len(self.gen.prompt_ids)),
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.generated,
            "max_tokens": self.gen.sampling.max_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 3),
            "tok_s": round(rate(self._token_times, now), 2),
            "slot": self.slot,
        }

    def finished_summary(self, exc_type: type[BaseException] | None = None) -> Finished:
        """What the request's log line and the monitor's recent list say about it once it ended."""
        if self.finished and self.last_event is not None:
            stop = self.stop_reason or self.last_event.finish_reason or "?"
            if self.last_event.finish_reason == "error":
                stop = "error: " + (self.last_event.error or "engine error")
        elif exc_type is None or issubclass(exc_type, (ClientGone, ConnectionError, asyncio.CancelledError)):
            stop = "cancelled (client gone)"
        else:
            stop = f"cancelled ({exc_type.__name__})"
        first = self.first_event
        return Finished(
            request_id=self.gen.request_id,
            api=self.api,
            prompt_tokens=first.prompt_tokens if first and first.prompt_tokens else len(self.gen.prompt_ids),
            cached_tokens=self.cached_tokens,
            output_tokens=self.completion_tokens,
            ttft_s=self.ttft_s,
            tok_s=self.decode_tok_s(),
            duration_s=time.monotonic() - self._started,
            stop=stop,
            ended=time.monotonic(),
            slot=self.slot,
        )

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far (the engine's count when it reports one)."""
        reported = self.last_event.completion_tokens if self.last_event else 0
        return max(reported, self.generated)

    @property
    def slot(self) -> int | None:
        """The engine slot serving the request (known from the first event, when the engine reports it)."""
        return self.first_event.slot if self.first_event else None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied (known after the first event)."""
        return self.first_event.cached_tokens if self.first_event else 0
