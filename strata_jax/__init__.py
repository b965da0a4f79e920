"""strata_jax: a JAX/XLA engine serving huge Mixture-of-Experts coding models from one GPU."""

from strata_jax.api import LoadedModel, load_model
from strata_jax.config import ModelConfig

__all__ = ["LoadedModel", "ModelConfig", "load_model"]
__version__ = "0.1.0"
