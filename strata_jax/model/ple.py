"""PLE (per-layer n-gram embedding), the device half: gating of the host-gathered n-gram rows by every
hyper-connection stream, plus a dilated causal conv. The rows themselves come from `ple_hash` on the host."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.activations import silu
from strata_jax.model.config import ModelConfig
from strata_jax.model.cache import PleCache
from strata_jax.model.conv import advance_tail, causal_conv
from strata_jax.model.layers import DepthwiseConvWeight, Linear, RMSNorm


class PleLayer(nnx.Module):
    """Adds hashed n-gram features to the streams: returns streams + delta [B, T, hc*H]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.hc = cfg.hc_count
        self.hidden = cfg.hidden_size
        self.dilation = cfg.ngram_size
        width = self.hc * self.hidden
        self.key_proj = Linear(cfg.ple_embed_dim, width, dtype)
        self.value_proj = Linear(cfg.ple_embed_dim, self.hidden, dtype)
        self.norm_key = RMSNorm(width, cfg.rms_norm_eps, dtype, group_size=self.hidden)
        self.norm_query = RMSNorm(width, cfg.rms_norm_eps, dtype, group_size=self.hidden)
        self.norm_conv = RMSNorm(width, cfg.rms_norm_eps, dtype, group_size=self.hidden)
        self.conv1d = DepthwiseConvWeight(width, cfg.ple_conv_kernel, dtype)

    def __call__(
        self, streams: jax.Array, rows: jax.Array, cache: PleCache, n_valid: jax.Array
    ) -> tuple[jax.Array, PleCache, jax.Array]:
        """`rows` [B, T, ple_embed_dim] are the concatenated n-gram embedding rows of each token. Also returns the
        conv input (what a verify pass needs to rebuild the conv state for an accepted prefix)."""
        split = lambda y: y.reshape(*y.shape[:-1], self.hc, self.hidden)  # noqa: E731
        rows = rows.astype(self.key_proj.weight.dtype)
        key = split(self.norm_key(self.key_proj(rows)))
        value = self.value_proj(rows)
        query = split(self.norm_query(streams))
        gate = jnp.sum(key * query, axis=-1, keepdims=True) / math.sqrt(self.hidden)
        gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), 1e-6)) * jnp.sign(gate)
        gated = (jax.nn.sigmoid(gate) * value[..., None, :]).reshape(streams.shape)
        conv_in = self.norm_conv(gated)
        conv_out, conv_state = causal_conv(conv_in, cache.conv, self.conv1d.kernel(), n_valid, self.dilation)
        delta = gated + silu(conv_out.astype(jnp.float32)).astype(gated.dtype)
        return streams + delta, PleCache(conv=conv_state), conv_in


def replay_ple(before: PleCache, conv_in: jax.Array, n_keep: jax.Array) -> PleCache:
    """The PLE conv state as if only the first `n_keep[b]` tokens of the window had been fed."""
    return PleCache(conv=advance_tail(before.conv, conv_in, n_keep))
