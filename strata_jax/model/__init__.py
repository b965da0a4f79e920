"""Pure Flax NNX model code: modules hold parameters only; caches are explicit pytrees passed in and returned.
`config` (the frozen `ModelConfig`) is JAX-free; the model classes load JAX when first named."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_jax.model.cache import ModelCache, init_cache
    from strata_jax.model.decoder import CausalLM

__all__ = ["CausalLM", "ModelCache", "init_cache"]
_LAZY = {"CausalLM": "strata_jax.model.decoder", "ModelCache": "strata_jax.model.cache",
         "init_cache": "strata_jax.model.cache"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strata_jax.model' has no attribute {name!r}")
