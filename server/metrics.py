"""Prometheus metrics for GET /metrics: the server's own counters and histograms plus the engine's `stats()`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
_SPEED_BUCKETS = (1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500, 1000)
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


class _EngineStatsCollector(Collector):
    """Exports every number of `engine.stats()` as `strata_engine_<key>` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float] | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats() or {}
        for key, value in sorted(stats.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = "strata_engine_" + _UNSAFE.sub("_", key)
                yield GaugeMetricFamily(name, f"engine stats() value {key!r}", value=float(value))


class ServerMetrics:
    """All metrics of one app, in their own registry (several apps may live in one process, e.g. in tests)."""

    def __init__(self, engine_stats: Callable[[], dict[str, float] | None]) -> None:
        """`engine_stats` returns the engine's stats() dict, or None while the model is loading."""
        disable_created_metrics()  # the `_created` series only add noise to a scrape
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("strata_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of generation requests", registry=r)
        self.completion_tokens = Counter("strata_completion_tokens", "tokens generated", registry=r)
        self.cache_hit_tokens = Counter(
            "strata_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.in_flight = Gauge("strata_generations_in_flight", "generation requests being served", registry=r)
        self.ttft = Histogram(
            "strata_time_to_first_token_seconds", "request received to first token", buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.decode_speed = Histogram(
            "strata_decode_tokens_per_second", "per-request decode speed after the first token",
            buckets=_SPEED_BUCKETS, registry=r,
        )
        self._engine_stats = engine_stats
        self.slots_busy = Gauge("strata_slots_busy", "engine slots decoding a request", registry=r)
        self.queue_length = Gauge("strata_queue_length", "requests waiting for a slot", registry=r)
        self.slots_busy.set_function(lambda: self._stat("slots_busy"))
        self.queue_length.set_function(lambda: self._stat("queue_length"))
        self.expert_hit_rate = Gauge(
            "strata_expert_gpu_hit_rate",
            "fraction of routed (token, expert) pairs served from the GPU expert pool since start (1 when every "
            "expert is on the GPU; the rest run on the host)", registry=r,
        )
        self.expert_hit_rate.set_function(lambda: self._stat("expert_gpu_hit_rate", default=1.0))
        r.register(_EngineStatsCollector(engine_stats))

    def _stat(self, key: str, default: float = 0.0) -> float:
        value: Any = (self._engine_stats() or {}).get(key, default)
        return float(value) if isinstance(value, (int, float)) else 0.0

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
