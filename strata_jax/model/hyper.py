"""Hyper-connections: `hc_count` residual streams replace the single residual and its layer norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.hyper_mix import hyper_mix
from pallas_kernels.hyper_mix import inject as inject
from strata_jax.config import ModelConfig
from strata_jax.model.layers import Linear, RMSNorm


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

    def __call__(
        self, streams: jax.Array, pending: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """streams [.., hc*H] -> (block input [.., H], inject weights [.., hc] or None without `combine`, the
        streams). `pending=(block_out, weights)` is an injection applied to the streams first (the returned streams
        include it). `pallas_kernels.hyper_mix` picks the implementation: XLA's fusions of the jnp form by default,
        until its Pallas kernels measure faster (docs/PERF.md)."""
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
