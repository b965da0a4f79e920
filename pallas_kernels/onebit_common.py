"""The packed 1-bit expert weights as a JAX pytree, plus small jnp helpers shared by the three paths.

Layout (see docs/FORMATS.md, "Packed expert format"): for a dense expert stack ``w [E, N, K]``
(N outputs, K inputs, HF orientation) with ``P`` residual planes and group size ``G``::

    bits   uint32 [E, P, K/32, N]        bit j of word w <-> input 32*w + j (LSB first); 1 -> +scale
    scales bf16   [E, P, ceil(K/G), N]   one scale per (input group, output channel, plane)

    w[e, n, 32*wd + j] ~= sum_p scales[e, p, (32*wd + j) // G, n] * (2 * bit(bits[e, p, wd, n], j) - 1)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

WORD_BITS = 32


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedWeights:
    """Device-side packed planes of one expert stack. ``group`` is static (pytree aux data)."""

    bits: jax.Array  # uint32 [E, P, K // 32, N]
    scales: jax.Array  # bfloat16 [E, P, ceil(K / group), N]
    group: int

    def tree_flatten(self):
        return (self.bits, self.scales), self.group

    @classmethod
    def tree_unflatten(cls, group, leaves):
        return cls(*leaves, group)

    @property
    def num_experts(self) -> int:
        return self.bits.shape[0]

    @property
    def planes(self) -> int:
        return self.bits.shape[1]

    @property
    def in_features(self) -> int:
        return self.bits.shape[2] * WORD_BITS

    @property
    def out_features(self) -> int:
        return self.bits.shape[3]

    @property
    def words_per_group(self) -> int:
        return self.group // WORD_BITS

    def bytes_per_expert(self) -> int:
        b = self.bits.shape[1:]
        s = self.scales.shape[1:]
        return int(np.prod(b)) * 4 + int(np.prod(s)) * 2


def as_packed(w) -> PackedWeights:
    """PackedWeights from a PackedWeights, or anything with .bits/.scales/.group (numpy PackedExperts)."""
    if isinstance(w, PackedWeights):
        return w
    bits = jnp.asarray(w.bits)
    scales = jnp.asarray(w.scales)
    if bits.dtype != jnp.uint32:
        raise TypeError(f"bits must be uint32, got {bits.dtype}")
    if scales.dtype != jnp.bfloat16:
        scales = scales.astype(jnp.bfloat16)
    return PackedWeights(bits, scales, int(w.group))


def check_shapes(x, expert_ids, expert_weights, gate_up: PackedWeights, down: PackedWeights):
    t, h = x.shape
    if expert_ids.shape != expert_weights.shape or expert_ids.shape[0] != t:
        raise ValueError(f"expert_ids {expert_ids.shape} / expert_weights {expert_weights.shape} vs x {x.shape}")
    if gate_up.in_features != h or down.out_features != h:
        raise ValueError(f"hidden {h} vs gate_up in {gate_up.in_features} / down out {down.out_features}")
    if gate_up.out_features != 2 * down.in_features:
        raise ValueError(f"gate_up out {gate_up.out_features} != 2 * down in {down.in_features}")
    if gate_up.num_experts != down.num_experts:
        raise ValueError("gate_up and down disagree on the number of experts")
    if gate_up.planes != down.planes:
        raise ValueError("gate_up and down must have the same number of planes")


def unpack_signs(bits: jax.Array) -> jax.Array:
    """uint32 [..., K/32, N] -> float32 +-1 [..., K, N] (input k = 32*w + j is bit j of word w)."""
    j = jnp.arange(WORD_BITS, dtype=jnp.uint32)[:, None]
    b = (bits[..., :, None, :] >> j) & jnp.uint32(1)  # [..., K/32, 32, N]
    b = b.reshape(*bits.shape[:-2], bits.shape[-2] * WORD_BITS, bits.shape[-1])
    return b.astype(jnp.float32) * 2.0 - 1.0


def expand_scales(scales: jax.Array, group: int, in_features: int) -> jax.Array:
    """[..., groups, N] -> float32 [..., K, N] (each group's scale repeated over its inputs)."""
    s = jnp.repeat(scales.astype(jnp.float32), group, axis=-2)
    return s[..., :in_features, :]


def dequantize(w: PackedWeights, ids: jax.Array | None = None) -> jax.Array:
    """Dense float32 weights [..., N, K] (HF orientation) of all experts, or of experts ``ids``."""
    bits, scales = (w.bits, w.scales) if ids is None else (w.bits[ids], w.scales[ids])
    k = w.in_features
    dense = jnp.sum(unpack_signs(bits) * expand_scales(scales, w.group, k), axis=-3)  # [..., K, N]
    return jnp.swapaxes(dense, -1, -2)


def silu(x):
    return x / (1.0 + jnp.exp(-x))


def launch(kernel, grid, out_shape, args, cfg, interpret: bool, poison: bool):
    """pallas_call of a kernel with the Triton lowering's ``cfg.num_warps`` / ``cfg.num_stages``. With ``poison``
    the output starts as NaN (an extra input aliased to it; the kernel drops it with ``strip_poison``) so that
    unwritten elements show."""
    kwargs = {}
    if poison:
        args = (*args, jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        kwargs["input_output_aliases"] = {len(args) - 1: 0}
    if not interpret:
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, **kwargs)(*args)


def strip_poison(refs, poison: bool):
    """A kernel's refs without ``launch``'s aliased poison input (the output ref is the same buffer)."""
    return refs[:-2] + refs[-1:] if poison else refs
