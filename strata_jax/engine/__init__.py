"""Serving engine: slots decoded by one fixed-shape jitted step, continuous batching, chunked prefill, sampling,
prefix cache. `api` is the JAX-free contract the server uses."""

from strata_jax.engine.api import GenerationRequest, PromptTooLong, RequestTiming, SamplingParams, TokenEvent
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "GenerationRequest", "PromptTooLong", "RequestTiming", "SamplingParams", "TokenEvent"]
