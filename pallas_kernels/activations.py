"""The activation shared by the kernels, the model and the host experts: one definition, so all compute one function.
Imports nothing of strata_jax (the model imports the kernels, never the reverse)."""

from __future__ import annotations

import jax
import numpy as np


def silu(x):
    """x * sigmoid(x), elementwise. A numpy array stays in numpy: the host's numpy kernel must never reach a device."""
    if isinstance(x, np.ndarray):
        return x / (1.0 + np.exp(-x))
    return x * jax.nn.sigmoid(x)
