"""Pallas kernels for strata_jax, each behind a pure-jnp reference.

``moe_experts_1bit``: the routed-expert computation of a MoE layer on packed 1-bit / multi-plane
weights (format: ``pallas_kernels.onebit_format``, docs/FORMATS.md "Packed expert format")::

    y[t] = sum_k w[t, k] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = expert_ids[t, k]

Implementations (``impl``):

* ``"reference"``: pure jnp, unpacks the routed experts to float32 and einsums (tests, small shapes).
* ``"xla"``: plain XLA, gathers the routed experts' packed words and unpacks them inside one
  reduction fusion per projection (float32 throughout). The fallback off-GPU; there, with more (token, expert)
  pairs than experts, ``expert_blocks`` instead: pairs sorted by expert, each expert unpacked once per block of
  its rows (a prefill chunk unpacks each expert ~2x, not once per pair).
* ``"pallas"``: the Pallas kernels (Triton lowering). ``default_config(T)`` picks, up to T = 128, the
  lookup-table kernels of ``onebit_lut`` (nibble tables of the activations, one gather per 4 weights; float32
  tables up to T = 4, bf16 from T = 8), and beyond that the MMA kernels of ``onebit_pallas`` (bf16 dot operands,
  float32 accumulation; x and the intermediate activation rounded to bf16). docs/PERF.md has the measurements.
* ``"auto"``: ``"pallas"`` when JAX's default backend is a GPU, else ``"xla"``.

Lowering: the Pallas kernels use the Triton lowering on every GPU (the only one implemented and
measured; it reaches consumer cards). A Mosaic GPU (``plgpu``) version for Hopper is future work --
see docs/PERF.md, which also says why the lookup-table form has no Mosaic GPU counterpart yet. Expert ids
must lie in ``[0, E)``; the kernels do not check.
"""

from __future__ import annotations

import jax

from pallas_kernels.delta_rule import gated_delta_decode
from pallas_kernels.expert_blocks import moe_experts_1bit_blocks
from pallas_kernels.onebit_common import as_packed, check_shapes
from pallas_kernels.onebit_format import PackedExperts, dequantize
from pallas_kernels.onebit_pallas import DEFAULT_CONFIG, KernelConfig, default_config, moe_experts_1bit_pallas
from pallas_kernels.onebit_reference import moe_experts_1bit_reference
from pallas_kernels.onebit_xla import moe_experts_1bit_xla

__all__ = [
    "DEFAULT_CONFIG",
    "KernelConfig",
    "PackedExperts",
    "as_packed",
    "default_config",
    "dequantize",
    "gated_delta_decode",
    "moe_experts_1bit",
    "moe_experts_1bit_blocks",
    "moe_experts_1bit_pallas",
    "moe_experts_1bit_reference",
    "moe_experts_1bit_xla",
    "resolve_impl",
]

IMPLS = ("auto", "reference", "xla", "pallas")


def resolve_impl(impl: str = "auto") -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def moe_experts_1bit(
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up,
    down,
    *,
    impl: str = "auto",
    interpret: bool = False,
    config: KernelConfig | None = None,
    poison: bool = False,
) -> jax.Array:
    """Routed experts on packed weights: x [T, H], expert_ids/expert_weights [T, k] -> [T, H] (x.dtype).

    ``gate_up`` packs the HF fused ``gate_up_proj`` [E, 2I, H] (gate = first I rows), ``down`` packs
    ``down_proj`` [E, H, I]; either as ``PackedExperts`` (numpy or jax arrays) or anything with .bits/.scales/.group.
    ``interpret`` runs the Pallas kernels in interpret mode (CPU tests); ``config`` picks schedule and
    tiles (default: ``default_config(T)``, tuned on an H200); ``poison`` (testing aid) starts the kernels' outputs
    as NaN so unwritten elements show.
    """
    gate_up, down = as_packed(gate_up), as_packed(down)
    check_shapes(x, expert_ids, expert_weights, gate_up, down)
    impl = resolve_impl(impl)
    if impl == "reference":
        return moe_experts_1bit_reference(x, expert_ids, expert_weights, gate_up, down)
    if impl == "xla" and jax.default_backend() != "gpu" and expert_ids.size > gate_up.num_experts:
        # More pairs than experts: unpack each expert once per block of its rows, not once per pair.
        return moe_experts_1bit_blocks(x, expert_ids, expert_weights, gate_up, down)
    if impl == "xla":
        return moe_experts_1bit_xla(x, expert_ids, expert_weights, gate_up, down)
    return moe_experts_1bit_pallas(
        x, expert_ids, expert_weights, gate_up, down, config=config, interpret=interpret, poison=poison
    )
