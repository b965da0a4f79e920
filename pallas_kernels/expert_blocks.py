"""Routed experts off a GPU, many tokens at once: rows sorted by expert, a loop over blocks of one expert each.

XLA:CPU expands `lax.ragged_dot` into a dense product over every expert (E times the work), and the per-pair XLA
form of the 1-bit experts (`onebit_xla`) unpacks an expert once per (token, slot) pair: at a 256-token prefill
chunk of the demo (16 experts, 4 per token) that is 64 unpacks of each expert. Here a loop walks blocks of rows of
one expert each, gets that expert's dense weights once per block (an index into dense weights, or the unpacking of
its packed words) and runs gate/up, SiLU and down on the block alone: the work is the rows' own plus at most one
partial block per expert, and a packed expert is unpacked about twice per call.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.activations import silu
from pallas_kernels.onebit_format import PackedExperts, dequantize

# expert index (traced int32) -> (gate_up [2I, H], down [H, I]) dense weights of that expert
WeightsOf = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def experts_by_blocks(xs: jax.Array, sizes: jax.Array, weights_of: WeightsOf, num_experts: int,
                      block: int | None = None) -> jax.Array:
    """Rows xs [M, H] sorted by expert (sizes [E] rows each) through their experts: float32 [M, H].

    The loop has ceil(M / block) + E iterations (a static bound); a block writes `block` rows from its first, and
    rows past its expert's last belong to the next block, which is written later and overwrites them (the output
    has `block` rows of slack at the end). Default block: a power of two near M / (2E), from 8 to 128."""
    m, h = xs.shape
    b = block or min(128, max(8, 1 << (max(1, m // (2 * num_experts)) - 1).bit_length()))
    n_blocks = -(-m // b) + num_experts
    per_expert = (sizes + b - 1) // b
    first_block = jnp.cumsum(per_expert) - per_expert  # [E]
    first_row = jnp.cumsum(sizes) - sizes
    j = jnp.arange(n_blocks)
    expert = jnp.clip(jnp.searchsorted(first_block + per_expert, j, side="right"), 0, num_experts - 1)
    used = j < jnp.sum(per_expert)
    start = jnp.where(used, first_row[expert] + (j - first_block[expert]) * b, m)  # unused blocks write the slack
    x_pad = jnp.concatenate([xs, jnp.zeros((b, h), xs.dtype)])

    def step(i, out):
        gate_up, down = weights_of(expert[i])
        inter = gate_up.shape[0] // 2
        x = jax.lax.dynamic_slice_in_dim(x_pad, start[i], b)
        gu = jnp.einsum("bh,oh->bo", x, gate_up)
        act = (silu(gu[:, :inter]) * gu[:, inter:]).astype(down.dtype)
        y = jnp.einsum("bi,hi->bh", act, down).astype(jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, y, start[i], 0)

    out = jax.lax.fori_loop(0, n_blocks, step, jnp.zeros((m + b, h), jnp.float32))
    return out[:m]


def sorted_pairs(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """expert_ids [T, k] -> (order [T*k]: the pairs sorted by expert, token of each sorted pair, rows per expert)."""
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, order // k, sizes


def run_sorted_by_expert(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, num_experts: int,
                         run: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """sum_k w_k * expert_k(x) with the (token, expert) pairs sorted by expert: `run(xs, sizes)` takes the pairs'
    rows [T*k, H] grouped by expert (sizes [E] rows each) and returns their float32 outputs; the weighted sum per
    token comes back float32 [T, H]."""
    order, token_of, sizes = sorted_pairs(expert_ids, num_experts)
    out = run(x[token_of], sizes) * expert_weights.astype(jnp.float32).reshape(-1)[order][:, None]
    return jnp.zeros((expert_ids.shape[0], x.shape[-1]), jnp.float32).at[token_of].add(out)


def moe_experts_1bit_blocks(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, gate_up: PackedExperts,
                            down: PackedExperts) -> jax.Array:
    """`moe_experts_1bit` in float32 for many tokens off a GPU: each block unpacks its expert once (the XLA form
    unpacks it per pair). Returns x.dtype [T, H]."""
    def weights_of(e):
        return dequantize(gate_up, e), dequantize(down, e)

    n = gate_up.num_experts
    out = run_sorted_by_expert(x.astype(jnp.float32), expert_ids, expert_weights, n,
                               lambda xs, sizes: experts_by_blocks(xs, sizes, weights_of, n))
    return out.astype(x.dtype)
