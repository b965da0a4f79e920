"""How `serve` listens: aiohttp's runner settings and a connection guard that caps open connections, closes
connections that stall before their first request head (slowloris), and answers malformed HTTP with JSON errors
in the APIs' shape instead of aiohttp's plain text."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from server.errors import generic_error_body

log = logging.getLogger("strata.server")

# Slow or stalled clients (slowloris) must not hold sockets. Body reads have their own limits (server/validation.py).
HEADER_TIMEOUT_S = 15.0  # a new connection must deliver its first request head within this
KEEPALIVE_TIMEOUT_S = 30.0  # an idle keep-alive connection is closed after this; aiohttp's keep-alive timer also
#                             closes a connection whose next request head is still incomplete after this
LINGERING_TIME_S = 5.0  # after an error answer, at most this long draining a body the handler did not read
MAX_CONNECTIONS = 512  # open connections at once; more are answered 503 and closed at once

# How the aiohttp server is run (main and the test harness alike). auto_decompress off: request bodies are
# decompressed by the app (server/validation.py), which gives unsupported/corrupt encodings API-shaped 415/400s.
RUNNER_SETTINGS: dict[str, Any] = {
    "handler_cancellation": True,  # a client that goes away cancels its handler at once (and its engine request)
    "auto_decompress": False,
    "keepalive_timeout": KEEPALIVE_TIMEOUT_S,
    "lingering_time": LINGERING_TIME_S,
}

_OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s")
_OVERLOADED_BODY = (b'{"type": "error", "error": {"type": "overloaded_error", "message": "too many open connections; '
                    b'retry shortly"}}')


class _ApiErrorRequestHandler(RequestHandler):
    """aiohttp's protocol, but its own error answers (malformed HTTP: bad request line, Content-Length or chunking,
    headers too long) are JSON errors, not plain text. The path is unknown there, so the body is the shape both
    SDKs read (errors.generic_error_body)."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs, and refuses if a response already started
        if status >= 500:
            text = "internal server error"
        else:
            text = (message or "").split("\n", 1)[0].strip().rstrip(":") or "malformed HTTP request"
            text = f"malformed HTTP request: {text}"
        response = web.Response(status=status, body=json.dumps(generic_error_body(status, text)).encode(),
                                content_type="application/json")
        response.force_close()
        return response


class ConnectionGuard:
    """A protocol factory around aiohttp's: caps open connections at `max_connections` (extra ones get a 503 and
    are closed) and closes a connection that has not sent a complete first request head within `header_timeout_s`
    (later heads on a kept-alive connection are bounded by aiohttp's keep-alive timeout)."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], *, max_connections: int = MAX_CONNECTIONS,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        self._factory = factory
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.timed_out = 0

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.max_connections:
            self.refused += 1
            return _Refuse()
        self.open += 1
        inner = self._factory()
        if type(inner) is RequestHandler:
            inner.__class__ = _ApiErrorRequestHandler  # same slots: only handle_error differs
        return _Guarded(inner, self)


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_OVERLOADED % (len(_OVERLOADED_BODY), _OVERLOADED_BODY))
        transport.close()


class _Guarded(asyncio.Protocol):
    """Forwards everything to aiohttp's protocol; watches for the end of the first request head."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, to find a head end split across reads
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(self._guard.header_timeout_s, self._head_timeout)
        self._inner.connection_made(transport)

    def _head_timeout(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._guard.timed_out += 1
            log.info("closing a connection that sent no complete request head within %gs",
                     self._guard.header_timeout_s)
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen or b"\n\n" in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._closed:
            self._closed = True
            self._guard.open -= 1
        self._inner.connection_lost(exc)


def make_runner(app: web.Application, **overrides: Any) -> web.AppRunner:
    """The AppRunner for `app` with RUNNER_SETTINGS (and `overrides`)."""
    return web.AppRunner(app, **{**RUNNER_SETTINGS, **overrides})


async def listen(runner: web.AppRunner, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> tuple[asyncio.AbstractServer, ConnectionGuard]:
    """Listen on host:port for a set-up `runner`, through a `ConnectionGuard`. Close the returned server before
    `runner.cleanup()`."""
    assert runner.server is not None, "call runner.setup() first"
    guard = ConnectionGuard(runner.server, max_connections=max_connections, header_timeout_s=header_timeout_s)
    server = await asyncio.get_running_loop().create_server(guard, host, port)
    return server, guard
