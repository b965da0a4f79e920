"""strata_jax: a JAX/XLA engine serving huge Mixture-of-Experts coding models from one GPU.

The package's names load lazily, so that importing a JAX-free part (the engine's protocol, the tokenizer) from the
HTTP server does not load JAX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_jax.loaded_model import LoadedModel, load_model
    from strata_jax.model.config import ModelConfig

__all__ = ["LoadedModel", "ModelConfig", "load_model"]
__version__ = "0.1.0"

_LAZY = {"LoadedModel": "strata_jax.loaded_model", "load_model": "strata_jax.loaded_model",
         "ModelConfig": "strata_jax.model.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strata_jax' has no attribute {name!r}")
