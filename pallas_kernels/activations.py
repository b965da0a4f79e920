"""The activation shared by the kernels, the model and the host experts: one definition, so all compute one function.
Imports nothing of strata_jax (the model imports the kernels, never the reverse)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def silu(x):
    """x * sigmoid(x) = x / (1 + exp(-x)), elementwise, in the form the Pallas kernels were tuned with (it lowers to
    one exp and one division in Triton). A numpy array stays in numpy: the host's numpy kernel must never reach a
    device."""
    if isinstance(x, np.ndarray):
        return x / (1.0 + np.exp(-x))
    return x / (1.0 + jnp.exp(-x))
