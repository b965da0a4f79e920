"""The live view behind `GET /v1/monitor` (and the web page's monitor): the requests being served now, token
throughput over the last seconds, recent times to first token, and the engine's counters turned into rates.

The server sees every token event of every request, so it measures throughput and time to first token itself; slot
occupancy, the queue, prefix-cache and GPU-expert hits come from the engine's `stats()`.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Any, Protocol

# Throughput is the tokens seen over this many trailing seconds (or since the first token, if that is more recent).
RATE_WINDOW_S = 5.0
# At most this many token times are kept per request and for the whole server (enough for the window at ~4000 tok/s
# for the server); a longer burst only makes the rate's window shorter, never wrong.
_MAX_TOKEN_TIMES = 20_000
_MAX_REQUEST_TOKEN_TIMES = 4_096
RECENT_REQUESTS = 50  # finished requests kept for the monitor's "recent" figures


class LiveRun(Protocol):
    """What the monitor reads from a request being served (`server.generation.EngineRun`)."""

    def snapshot(self, now: float) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Finished:
    """One finished request, as the monitor and the request log line report it."""

    request_id: str
    api: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    tok_s: float | None
    duration_s: float
    stop: str
    ended: float  # time.monotonic() at the end
    slot: int | None = None  # the engine slot that served it (None: the engine did not say, or it never got one)


def rate(times: collections.deque[float], now: float, window_s: float = RATE_WINDOW_S) -> float:
    """Events per second among `times` (ascending monotonic seconds): over the trailing `window_s`, or, when every
    kept time lies inside the window (a young stream), from the first of them to `now` (the first event starts the
    clock, so it is not counted)."""
    if not times:
        return 0.0
    start = now - window_s
    if times[0] >= start:
        return (len(times) - 1) / (now - times[0]) if len(times) > 1 and now > times[0] else 0.0
    n = 0
    for t in reversed(times):
        if t < start:
            break
        n += 1
    return n / window_s


def token_times(limit: int = _MAX_REQUEST_TOKEN_TIMES) -> collections.deque[float]:
    """A bounded deque for token arrival times."""
    return collections.deque(maxlen=limit)


class Monitor:
    """Live requests, server-wide token times and recent finished requests. Used from the event loop only."""

    def __init__(self) -> None:
        """An empty monitor; `started` is when the server started (monotonic seconds)."""
        self.started = time.monotonic()
        self.live: dict[str, LiveRun] = {}
        self.tokens = token_times(_MAX_TOKEN_TIMES)
        self.recent: collections.deque[Finished] = collections.deque(maxlen=RECENT_REQUESTS)
        self.finished_total = 0

    def begin(self, request_id: str, run: LiveRun) -> None:
        """`run` is being served from now on."""
        self.live[request_id] = run

    def token(self, now: float) -> None:
        """One token was generated (by any request) at `now`."""
        self.tokens.append(now)

    def end(self, request_id: str, finished: Finished) -> None:
        """The request ended (normally or not)."""
        self.live.pop(request_id, None)
        self.recent.append(finished)
        self.finished_total += 1

    def snapshot(self, engine_stats: dict[str, Any] | None) -> dict[str, Any]:
        """The monitor's JSON: slots, queue, throughput, live requests, recent figures and the engine's rates."""
        now = time.monotonic()
        stats = engine_stats or {}
        requests = sorted((run.snapshot(now) for run in self.live.values()), key=lambda r: -r["age_s"])
        ttfts = [f.ttft_s for f in self.recent if f.ttft_s is not None]
        speeds = [f.tok_s for f in self.recent if f.tok_s]
        prompt_total = _number(stats.get("prompt_tokens_total"))
        hits = _number(stats.get("prefix_cache_hit_tokens_total"))
        drafted = _number(stats.get("draft_tokens_total"))
        return {
            "uptime_s": round(now - self.started, 1),
            "slots": {"busy": _int(stats.get("slots_busy"), len(self.live)), "total": _int(stats.get("slots_total"))},
            "queue": _int(stats.get("queue_length")),
            "tok_s": round(rate(self.tokens, now), 2),
            "requests": requests,
            "recent": {
                "count": len(self.recent),
                "ttft_last_s": _round(ttfts[-1] if ttfts else None, 3),
                "ttft_p50_s": _round(statistics.median(ttfts) if ttfts else None, 3),
                "tok_s_p50": _round(statistics.median(speeds) if speeds else None, 2),
                "last": [_finished_row(f, now) for f in list(self.recent)[-10:]],
            },
            "totals": {
                "requests": _int(stats.get("requests_total"), self.finished_total + len(self.live)),
                "prompt_tokens": int(prompt_total),
                "generated_tokens": _int(stats.get("generated_tokens_total")),
                "prefix_cache_hit_tokens": int(hits),
                "prefix_cache_hit_rate": _round(hits / prompt_total if prompt_total else None, 4),
                "expert_gpu_hit_rate": _round(_number(stats.get("expert_gpu_hit_rate"), None), 4),
                "draft_acceptance": _round(_number(stats.get("accepted_draft_tokens_total")) / drafted
                                           if drafted else None, 4),
            },
        }


def _finished_row(f: Finished, now: float) -> dict[str, Any]:
    row = dataclasses.asdict(f)
    del row["ended"]
    return row | {"ttft_s": _round(f.ttft_s, 3), "tok_s": _round(f.tok_s, 2), "duration_s": round(f.duration_s, 3),
                  "ago_s": round(now - f.ended, 1)}


def _number(value: Any, default: float | None = 0.0) -> Any:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _int(value: Any, default: int = 0) -> int:
    number = _number(value, None)
    return default if number is None else int(number)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
