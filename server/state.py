"""What every handler needs: the engine (None while loading), the tokenizer, settings and metrics."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from aiohttp import web

from strata_jax.engine.protocol import EngineProtocol
from strata_jax.tokenizer import Tokenizer

from server.errors import ApiError
from server.metrics import ServerMetrics
from server.monitor import Monitor


@dataclasses.dataclass
class ServerState:
    """Mutable server state; the engine and tokenizer are installed once loading finishes."""

    served_name: str
    api_key: str | None
    context_length: int
    max_body_bytes: int
    heartbeat_s: float
    body_idle_timeout_s: float = 30.0  # reading a request body: longest wait for the next byte
    body_total_timeout_s: float = 300.0  # reading a request body: longest in all
    engine: EngineProtocol | None = None
    tokenizer: Tokenizer | None = None
    # What the monitor shows about the set-up (model, dtype, slots, context, drafter, memory plan rows); set by serve.
    about: dict[str, Any] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)
    # Offered tools become the answer's grammar (calls name only them, arguments follow their schemas); serve's
    # --no-constrain-tools turns it off.
    constrain_tools: bool = True
    metrics: ServerMetrics = dataclasses.field(init=False)
    monitor: Monitor = dataclasses.field(default_factory=Monitor)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine_stats)

    @property
    def ready(self) -> bool:
        """True once the engine and tokenizer are installed."""
        return self.engine is not None and self.tokenizer is not None

    def engine_stats(self) -> dict[str, Any] | None:
        """The engine's stats(), or None while loading (or if stats() fails: metrics must never 500)."""
        if self.engine is None:
            return None
        try:
            return self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because of the engine
            return None

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt the context takes (one token is left to generate); None before it is known."""
        return self.context_length - 1 if self.context_length > 1 else None

    def engine_health(self) -> tuple[bool, str]:
        """The engine's (healthy, why not); engines without `health()` count as healthy once installed."""
        health = getattr(self.engine, "health", None)
        if self.engine is None:
            return False, "the model is still loading"
        if health is None:
            return True, ""
        try:
            return health()
        except Exception as exc:  # noqa: BLE001 - a probe must answer
            return False, f"health check failed: {exc}"

    def require_ready(self) -> tuple[EngineProtocol, Tokenizer]:
        """(engine, tokenizer), or a 529 overloaded error while the model is loading (clients retry 529)."""
        if self.engine is None or self.tokenizer is None:
            raise ApiError(529, "the model is still loading; retry shortly", headers={"retry-after": "5"})
        return self.engine, self.tokenizer


STATE: web.AppKey[ServerState] = web.AppKey("strata_state", ServerState)

# Per-request id (also the engine request id and the `request-id` response header). RequestKey is aiohttp >= 3.12.
REQUEST_ID: Any = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"
