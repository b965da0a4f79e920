"""Sparse MoE block: softmax router, top-k (renormalised), routed experts and a sigmoid-gated shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import PackedWeights, moe_experts_1bit
from strata_jax.config import ExpertQuantization, ModelConfig
from strata_jax.model.layers import MLP, Linear, silu
from strata_jax.model.params import empty_param


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] -> (expert ids [N, k] int32, weights [N, k] float32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def experts_reference(
    x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array
) -> jax.Array:
    """Routed experts on dense weights: sum_k w_k * down_e(silu(gate_e x) * up_e x).

    x [N, H]; ids/weights [N, k]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]. Few tokens gather
    their experts' weights; many tokens are sorted by expert and run as one grouped (ragged) matmul.
    """
    n, k = ids.shape
    n_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    xw = x.astype(gate_up.dtype)
    if n * k <= n_experts:
        gu = jnp.einsum("nh,nkoh->nko", xw, gate_up[ids])
        act = silu(gu[..., :inter]) * gu[..., inter:]
        out = jnp.einsum("nki,nkhi->nkh", act, down[ids])
        return jnp.einsum("nkh,nk->nh", out.astype(jnp.float32), weights).astype(x.dtype)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    xs = xw[token_of]
    gu = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), sizes)
    act = (silu(gu[:, :inter]) * gu[:, inter:]).astype(down.dtype)
    out = jax.lax.ragged_dot(act, jnp.swapaxes(down, 1, 2), sizes).astype(jnp.float32)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(out).astype(x.dtype)


class Experts(nnx.Module):
    """Routed expert weights, fused as in HF: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = empty_param((e, 2 * i, h), dtype)
        self.down_proj = empty_param((e, h, i), dtype)

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
        return experts_reference(x, ids, weights, self.gate_up_proj[...], self.down_proj[...])


class PackedExperts(nnx.Module):
    """Routed experts as packed sign bit-planes + bf16 group scales, multiplied by `pallas_kernels`."""

    def __init__(self, cfg: ModelConfig, quant: ExpertQuantization):
        e, i, h, p, g = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, quant.planes, quant.group
        self.quant = quant
        self.gate_up_bits = empty_param((e, p, h // 32, 2 * i), jnp.uint32)
        self.gate_up_scales = empty_param((e, p, -(-h // g), 2 * i), jnp.bfloat16)
        self.down_bits = empty_param((e, p, i // 32, h), jnp.uint32)
        self.down_scales = empty_param((e, p, -(-i // g), h), jnp.bfloat16)

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
        g = self.quant.group
        gate_up = PackedWeights(self.gate_up_bits[...], self.gate_up_scales[...], g)
        down = PackedWeights(self.down_bits[...], self.down_scales[...], g)
        return moe_experts_1bit(x, ids, weights, gate_up, down, impl=self.quant.impl)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.weight = empty_param((cfg.num_experts, cfg.hidden_size), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("nh,eh->ne", x.astype(self.weight.dtype), self.weight[...])


class SparseMoe(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, quant: ExpertQuantization | None = None):
        self.cfg = cfg
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype) if quant is None else PackedExperts(cfg, quant)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = route(self.gate(flat), self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        routed = self.experts(flat, ids, weights)
        shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(shape)
