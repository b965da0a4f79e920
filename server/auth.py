"""API-key check: `x-api-key: KEY` (Anthropic SDKs) or `Authorization: Bearer KEY` (Claude Code's
ANTHROPIC_AUTH_TOKEN, OpenAI SDKs), compared in constant time. /health, / and the web page's files (/ui/) stay open
(probes, Claude Code's `HEAD /` warm-up, a page that asks for the key itself); with `metrics_public`, /metrics is
open to clients on this machine (a local Prometheus) and still needs the key from elsewhere."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web

from server.errors import ApiError

OPEN_PATHS = frozenset({"/", "/health"})
OPEN_PREFIXES = ("/ui/",)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def presented_keys(request: web.Request) -> list[str]:
    """The keys a request presents (either header may carry it)."""
    keys = []
    if api_key := request.headers.get("x-api-key"):
        keys.append(api_key.strip())
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    return keys


def key_matches(expected: str, presented: list[str]) -> bool:
    """True if any presented key equals `expected` (constant-time comparison of each)."""
    want = expected.encode()
    ok = False
    for key in presented:
        ok |= hmac.compare_digest(want, key.encode())
    return ok


def from_loopback(request: web.Request) -> bool:
    """Whether the request's peer is this machine (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def needs_key(request: web.Request, metrics_public: bool = False) -> bool:
    """Whether `request`'s path is behind the API key (when the server has one)."""
    if request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
        return False
    return not (metrics_public and request.path == "/metrics" and from_loopback(request))


def auth_middleware(api_key: str | None, *, metrics_public: bool = False
                    ) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware that answers 401 unless the request carries `api_key` (a no-op when no key is set); with
    `metrics_public`, /metrics needs no key from a loopback peer."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key and needs_key(request, metrics_public) and not key_matches(api_key, presented_keys(request)):
            reason = "missing" if not presented_keys(request) else "invalid"
            raise ApiError(401, f"{reason} API key: send it as `x-api-key: KEY` or `Authorization: Bearer KEY`")
        return await handler(request)

    return check_key
