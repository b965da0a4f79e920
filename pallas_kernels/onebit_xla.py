"""Plain-XLA fallback for the 1-bit MoE: gather the routed experts' packed words, unpack in registers.

Written so that XLA emits one reduction fusion per projection: the gather of the k experts' words,
the shifts/ands, the sign*scale select and the multiply with x are all producers of a reduce over
the input axis, so the unpacked weights never exist in memory. Reads each (token, slot) pair's
expert bytes once (no de-duplication across tokens); used where Pallas is not available (CPU, or
as a baseline).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.activations import silu
from pallas_kernels.onebit_format import WORD_BITS, PackedExperts


def _project(xin: jax.Array, ids: jax.Array, w: PackedExperts) -> jax.Array:
    """xin [T, K] or [T, k, K] float32, ids [T, k] -> [T, k, N] float32 (per-pair projections)."""
    t, k = ids.shape
    kw = w.bits.shape[2]
    words = w.bits[ids]  # [T, k, P, KW, N]
    sc = w.scales[ids].astype(jnp.float32)  # [T, k, P, G, N]
    sc = jnp.repeat(sc, w.words_per_group, axis=3)[:, :, :, :kw]  # scale per word [T, k, P, KW, N]
    j = jnp.arange(WORD_BITS, dtype=jnp.uint32)[:, None]
    bit = (words[..., None, :] >> j) & jnp.uint32(1)  # [T, k, P, KW, 32, N]
    val = jnp.where(bit != 0, sc[..., None, :], -sc[..., None, :])
    if xin.ndim == 2:
        xr = xin.reshape(t, 1, 1, kw, WORD_BITS, 1)
    else:
        xr = xin.reshape(t, k, 1, kw, WORD_BITS, 1)
    return jnp.sum(xr * val, axis=(2, 3, 4))


def moe_experts_1bit_xla(
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up: PackedExperts,
    down: PackedExperts,
) -> jax.Array:
    inter = down.in_features
    g = _project(x.astype(jnp.float32), expert_ids, gate_up)  # [T, k, 2I]
    a = silu(g[..., :inter]) * g[..., inter:]
    y = _project(a, expert_ids, down)  # [T, k, H]
    out = jnp.sum(y * expert_weights.astype(jnp.float32)[..., None], axis=1)
    return out.astype(x.dtype)
