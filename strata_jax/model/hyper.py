"""Hyper-connections: `hc_count` residual streams replace the single residual and its layer norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.activations import silu
from pallas_kernels.hyper_mix import hyper_mix
from pallas_kernels.hyper_mix import inject as inject
from strata_jax.model.config import ModelConfig
from strata_jax.model.layers import Linear, RMSNorm


def prefolded(gamma: jax.Array, w_down: jax.Array, w_inject: jax.Array | None) -> jax.Array:
    """[w_down; w_inject] ([R + hc, hc*H], or w_down alone) with the grouped norm's (1 + gamma) folded into their
    columns, rounded to w_down's dtype: the weights `prefold_mix` multiplies by."""
    f32 = jnp.float32
    both = w_down if w_inject is None else jnp.concatenate([w_down, w_inject])
    return (both.astype(f32) * (1 + gamma.astype(f32))).astype(w_down.dtype)


def prefold_mix(streams, gamma, w_proj, w_up, pending=None, *, hc: int, eps: float):
    """`hyper_mix` on `prefolded` weights: each stream group normalised without gamma, then the down and inject
    projections as one GEMM (one XLA kernel fewer than the jnp form). Equal to the jnp form up to where bf16
    rounding happens: the projections see ``rsqrt(..) * x`` rounded, and weights with (1 + gamma) folded in, where
    the reference rounds ``normed`` itself. Returns (mixed, inject weights or None, new streams)."""
    if pending is not None:
        streams = inject(streams, *pending)
    f32, dtype = jnp.float32, streams.dtype
    hidden, rank = streams.shape[-1] // hc, w_up.shape[-1]
    x = streams.reshape(*streams.shape[:-1], hc, hidden).astype(f32)
    scale = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    unit = (x * scale).astype(dtype).reshape(streams.shape)
    proj = jnp.einsum("...i,oi->...o", unit.astype(w_proj.dtype), w_proj).astype(f32)
    v = (proj[..., :rank] / hc).astype(dtype)
    act = silu(v)
    mix = jax.nn.sigmoid(jnp.einsum("...r,or->...o", act.astype(w_up.dtype), w_up)).reshape(x.shape)
    normed = (x * scale * (1 + gamma.astype(f32)).reshape(hc, hidden)).astype(dtype)
    mixed = jnp.mean(mix * normed, axis=-2).astype(dtype)
    weights = (2 * jax.nn.sigmoid(proj[..., rank:] / hc)).astype(dtype) if w_proj.shape[0] > rank else None
    return mixed, weights, streams


class HyperConnection(nnx.Module):
    """Mixes the streams [.., hc*H] into one block input [.., H]; with `combine`, also returns the per-stream
    weights with which the block's output is injected back (`inject`)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, combine: bool = True):
        self.hc = cfg.hc_count
        self.hidden = cfg.hidden_size
        width = self.hc * self.hidden
        self.hc_norm = RMSNorm(width, cfg.rms_norm_eps, dtype, group_size=self.hidden)
        self.input_mix_weight_down = Linear(width, cfg.hc_lowrank, dtype)
        self.input_mix_weight_up = Linear(cfg.hc_lowrank, width, dtype)
        self.block_inject_weight = Linear(width, self.hc, dtype) if combine else None
        self.prefolded = False

    def prefold(self) -> None:
        """Switches this connection to `prefold_mix`: the down projection's weight becomes the `prefolded` [down;
        inject] matrix and the inject projection goes. The checkpoint names no longer match, so call it after
        loading (`prefold_hyper_connections`)."""
        if self.prefolded:
            return
        inject_w = None if self.block_inject_weight is None else self.block_inject_weight.weight[...]
        down = self.input_mix_weight_down.weight
        down.set_value(prefolded(self.hc_norm.weight[...], down[...], inject_w))
        self.block_inject_weight = None
        self.prefolded = True

    def __call__(
        self, streams: jax.Array, pending: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """streams [.., hc*H] -> (block input [.., H], inject weights [.., hc] or None without `combine`, the
        streams). `pending=(block_out, weights)` is an injection applied to the streams first (the returned streams
        include it). `pallas_kernels.hyper_mix` picks the implementation: XLA's fusions of the jnp form by default,
        until its Pallas kernels measure faster (docs/PERF.md); `prefold_mix` after `prefold`."""
        if self.prefolded:
            return prefold_mix(streams, self.hc_norm.weight[...], self.input_mix_weight_down.weight[...],
                               self.input_mix_weight_up.weight[...], pending, hc=self.hc, eps=self.hc_norm.eps)
        inject_w = self.block_inject_weight
        return hyper_mix(
            streams,
            self.hc_norm.weight[...],
            self.input_mix_weight_down.weight[...],
            self.input_mix_weight_up.weight[...],
            None if inject_w is None else inject_w.weight[...],
            hc=self.hc,
            eps=self.hc_norm.eps,
            pending=pending,
        )


def prefold_hyper_connections(model: nnx.Module) -> int:
    """`HyperConnection.prefold` on every hyper-connection of a loaded model (an experiment, off by default: it
    measured no faster in the step, docs/PERF.md). Returns how many were switched."""
    connections = [node for _, node in nnx.iter_graph(model) if isinstance(node, HyperConnection)]
    for connection in connections:
        connection.prefold()
    return len(connections)
