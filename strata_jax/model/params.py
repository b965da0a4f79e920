"""Parameter creation. Modules are built abstractly (under `nnx.eval_shape`) and filled from a checkpoint,
so a parameter starts as zeros of the right shape and dtype and is never randomly initialised here."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def empty_param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))
