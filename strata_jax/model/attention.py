"""Gated full attention (GQA, q/k norm, per-head sigmoid output gate) with the optional QSA block indexer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.decode_attention import decode_attention
from strata_jax.model.config import ModelConfig
from strata_jax.model.cache import AttentionCache
from strata_jax.model.layers import Linear, RMSNorm, apply_rope, rope_cos_sin


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new [B, T, ...] into cache [B, S, ...] at positions [B, T]; positions >= S are dropped."""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


def _write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new [B, T, H, D] into cache [B, H, S, D] at positions [B, T]; positions >= S are dropped. (The
    index arrays around the head slice put their broadcast dims first: the update is addressed as [B, T, H, D].)"""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, :, positions].set(new.astype(cache.dtype), mode="drop")


class QSAIndexer(nnx.Module):
    """Scores blocks of `compress_ratio` keys and keeps the best `budget / compress_ratio` complete blocks plus the
    incomplete tail; attention then sees only the selected tokens (below `budget` tokens: everything)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.cfg = cfg
        d = cfg.indexer_head_dim
        self.index_qk_proj = Linear(cfg.hidden_size, (cfg.indexer_n_heads + 1) * d, dtype)
        self.q_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)

    def __call__(
        self, x: jax.Array, positions: jax.Array, index_k: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Returns the selection mask [B, T, S] (before the causal mask) and the updated raw index keys."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        d, c = cfg.indexer_head_dim, cfg.indexer_compress_ratio
        qk = self.index_qk_proj(x)
        q = qk[..., : cfg.indexer_n_heads * d].reshape(bsz, t, cfg.indexer_n_heads, d)
        q = apply_rope(self.q_layernorm(q), cos, sin)
        index_k = _write(index_k, qk[..., cfg.indexer_n_heads * d :], positions)
        s = index_k.shape[1]
        n_blocks = s // c
        pooled = jnp.mean(index_k.reshape(bsz, n_blocks, c, d).astype(jnp.float32), axis=2).astype(index_k.dtype)
        pooled = self.k_layernorm(pooled)
        bcos, bsin = rope_cos_sin(jnp.arange(n_blocks) * c, cfg.rotary_dim, cfg.rope_theta)
        block_keys = apply_rope(pooled[:, :, None, :], bcos, bsin)[:, :, 0, :]
        scores = jnp.einsum("bthd,bnd->btnh", q.astype(jnp.float32), block_keys.astype(jnp.float32))
        scores = jnp.sum(jax.nn.relu(scores), axis=-1) / math.sqrt(d)  # [B, T, NB]
        n_complete = (positions + 1) // c  # [B, T]
        block_ids = jnp.arange(n_blocks)
        complete = block_ids[None, None, :] < n_complete[..., None]
        top = cfg.indexer_budget // c
        if n_blocks > top:
            masked = jnp.where(complete, scores, -jnp.inf)
            _, best = jax.lax.top_k(masked, top)
            chosen = jnp.zeros(scores.shape, bool).at[
                jnp.arange(bsz)[:, None, None], jnp.arange(t)[None, :, None], best
            ].set(True)
            chosen = chosen & complete
        else:
            chosen = complete
        token_ids = jnp.arange(s)
        in_complete_block = token_ids[None, None, :] < (n_complete * c)[..., None]
        selected = jnp.where(in_complete_block, chosen[..., token_ids // c], True)
        return selected, index_k


class Attention(nnx.Module):
    """Gated attention of every 4th layer."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d * 2, dtype)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, dtype)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, dtype)
        self.o_proj = Linear(cfg.num_heads * d, h, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        if cfg.qsa:
            self.indexer = QSAIndexer(cfg, dtype)

    def __call__(
        self, x: jax.Array, cache: AttentionCache, start: jax.Array
    ) -> tuple[jax.Array, AttentionCache]:
        cfg = self.cfg
        bsz, t, _ = x.shape
        d, kvh = cfg.head_dim, cfg.num_kv_heads
        group = cfg.num_heads // kvh
        positions = start[:, None] + jnp.arange(t)[None, :]
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)

        qg = self.q_proj(x).reshape(bsz, t, cfg.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(bsz, t, -1)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(bsz, t, kvh, d)), cos, sin)
        v = self.v_proj(x).reshape(bsz, t, kvh, d)
        k_all = _write_kv(cache.k, k, positions)
        v_all = _write_kv(cache.v, v, positions)
        s = k_all.shape[2]

        mask = jnp.arange(s)[None, None, :] <= positions[..., None]  # [B, T, S]
        index_k = cache.index_k
        if cfg.qsa:
            selected, index_k = self.indexer(x, positions, index_k, cos, sin)
            mask = mask & selected

        # The kernel (on a GPU, for decode and verify) reads each slot's cache only up to its last new token.
        lengths = jnp.minimum(start + t, s)
        out = decode_attention(q.reshape(bsz, t, kvh, group, d), k_all, v_all, mask, lengths).reshape(bsz, t, -1)
        out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out), AttentionCache(k=k_all, v=v_all, index_k=index_k)
