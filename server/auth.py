"""API-key check: `x-api-key: KEY` (Anthropic SDKs) or `Authorization: Bearer KEY` (Claude Code's
ANTHROPIC_AUTH_TOKEN, OpenAI SDKs), compared in constant time. /health and / stay open (probes, Claude Code's
`HEAD /` warm-up)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from server.errors import ApiError

OPEN_PATHS = frozenset({"/", "/health"})

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


def auth_middleware(api_key: str | None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware that answers 401 unless the request carries `api_key` (a no-op when no key is set)."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key and request.path not in OPEN_PATHS and not key_matches(api_key, presented_keys(request)):
            reason = "missing" if not presented_keys(request) else "invalid"
            raise ApiError(401, f"{reason} API key: send it as `x-api-key: KEY` or `Authorization: Bearer KEY`")
        return await handler(request)

    return check_key
