"""Launch helpers shared by the 1-bit expert kernels: operand conversion and checks, the Pallas launch and its
poison aid. The packed format itself is `pallas_kernels.onebit_format`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.onebit_format import PackedExperts, check_pair


def as_packed(w) -> PackedExperts:
    """A kernel operand: `PackedExperts` of jax arrays in the words layout, from a `PackedExperts` of numpy or jax
    arrays, or from anything with .bits/.scales/.group (scales of another float dtype are rounded to bf16)."""
    layout = getattr(w, "layout", "words")
    if layout != "words":
        raise ValueError(f"the kernels read packed words, got the {layout} layout")
    if isinstance(w, PackedExperts) and not isinstance(w.bits, np.ndarray):
        return w
    bits = jnp.asarray(w.bits)
    scales = jnp.asarray(w.scales)
    if bits.dtype != jnp.uint32:
        raise TypeError(f"bits must be uint32, got {bits.dtype}")
    if scales.dtype != jnp.bfloat16:
        scales = scales.astype(jnp.bfloat16)
    return PackedExperts(bits, scales, int(w.group))


def check_shapes(x, expert_ids, expert_weights, gate_up: PackedExperts, down: PackedExperts) -> None:
    """Raises ValueError unless x [T, H], expert_ids / expert_weights [T, k] and the two stacks fit together."""
    t, h = x.shape
    if expert_ids.shape != expert_weights.shape or expert_ids.shape[0] != t:
        raise ValueError(f"expert_ids {expert_ids.shape} / expert_weights {expert_weights.shape} vs x {x.shape}")
    if gate_up.in_features != h or down.out_features != h:
        raise ValueError(f"hidden {h} vs gate_up in {gate_up.in_features} / down out {down.out_features}")
    check_pair(gate_up, down)


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
