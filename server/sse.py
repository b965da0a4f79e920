"""Server-sent events over aiohttp's own `StreamResponse`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


async def start_sse(request: web.Request) -> web.StreamResponse:
    """Send the 200 and SSE headers; returns the response to write events to."""
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer the stream
        },
    )
    await response.prepare(request)
    return response


def sse_frame(data: Any, event: str | None = None) -> bytes:
    """One SSE frame: an optional `event:` line and a `data:` line (JSON unless `data` is a str)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    # "replace": a lone surrogate (which requests cannot bring in: validation refuses them) must not break a stream
    return f"{head}data: {payload}\n\n".encode("utf-8", "replace")


async def send_events(response: web.StreamResponse, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Write named events (the Anthropic style: the event name repeats the data's `type`) in one write."""
    if events:
        await response.write(b"".join(sse_frame(data, name) for name, data in events))
