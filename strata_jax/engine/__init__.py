"""Serving engine: slots decoded by one fixed-shape jitted step, continuous batching, chunked prefill, sampling,
prefix cache. `protocol` is the JAX-free contract the server uses; `Engine` (which loads JAX) is imported lazily."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from strata_jax.engine.config import EngineConfig
from strata_jax.engine.protocol import GenerationRequest, PromptTooLong, RequestTiming, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from strata_jax.engine.engine import Engine

__all__ = [
    "Engine", "EngineConfig", "GenerationRequest", "PromptTooLong", "RequestTiming", "SamplingParams", "TokenEvent",
]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        return importlib.import_module("strata_jax.engine.engine").Engine
    raise AttributeError(f"module 'strata_jax.engine' has no attribute {name!r}")
