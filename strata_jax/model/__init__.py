"""Pure Flax NNX model code: modules hold parameters only; caches are explicit pytrees passed in and returned."""

from strata_jax.model.cache import ModelCache, init_cache
from strata_jax.model.decoder import CausalLM

__all__ = ["CausalLM", "ModelCache", "init_cache"]
