"""Pure-jnp reference of the routed-expert MoE on packed 1-bit weights: unpack, then einsum.

Clear rather than fast: it dequantizes the routed experts to float32 (``[T, k, N, K]`` floats), so use
it for tests and small shapes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.activations import silu
from pallas_kernels.onebit_format import PackedExperts, dequantize

_HI = jax.lax.Precision.HIGHEST


def moe_experts_1bit_reference(
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up: PackedExperts,
    down: PackedExperts,
) -> jax.Array:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x), all in float32; returns x.dtype [T, H]."""
    inter = down.in_features
    xf = x.astype(jnp.float32)
    gu = dequantize(gate_up, expert_ids)  # [T, k, 2I, H]
    dn = dequantize(down, expert_ids)  # [T, k, H, I]
    g = jnp.einsum("th,tkoh->tko", xf, gu, precision=_HI)
    a = silu(g[..., :inter]) * g[..., inter:]
    y = jnp.einsum("tki,tkhi->tkh", a, dn, precision=_HI)
    out = jnp.einsum("tkh,tk->th", y, expert_weights.astype(jnp.float32), precision=_HI)
    return out.astype(x.dtype)
