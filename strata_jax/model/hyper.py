"""Hyper-connections: `hc_count` residual streams replace the single residual and its layer norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.config import ModelConfig
from strata_jax.model.layers import Linear, RMSNorm, silu


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

    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        normed = self.hc_norm(streams)
        mix = silu(self.input_mix_weight_down(normed) / self.hc)
        mix = jax.nn.sigmoid(self.input_mix_weight_up(mix))
        split = lambda y: y.reshape(*y.shape[:-1], self.hc, self.hidden)  # noqa: E731
        mixed = jnp.mean(split(mix) * split(normed), axis=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * jax.nn.sigmoid(self.block_inject_weight(normed) / self.hc)


def inject(streams: jax.Array, block_out: jax.Array, weights: jax.Array) -> jax.Array:
    """streams [.., hc*H] + block_out [.., H] broadcast to every stream, scaled per stream by weights [.., hc]."""
    added = block_out[..., None, :] * weights[..., :, None]
    return streams + added.reshape(streams.shape)
