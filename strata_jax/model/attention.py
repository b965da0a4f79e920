"""Gated full attention (GQA, q/k norm, per-head sigmoid output gate) with the optional QSA block indexer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.decode_attention import MAX_TOKENS, decode_attention, quantize_kv
from pallas_kernels.flash_prefill import attend_prefill, resolve_prefill_impl
from pallas_kernels.prefill_attention import dense_mask, prefill_attention
from pallas_kernels.selected_attention import selected_attention
from pallas_kernels.selected_flash import selected_flash
from strata_jax.model.config import ModelConfig
from strata_jax.model.cache import AttentionCache
from strata_jax.model.layers import Linear, RMSNorm, apply_rope, rope_cos_sin


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new [B, T, ...] into cache [B, S, ...] at positions [B, T]; positions >= S are dropped."""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


def _write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new [B, T, H, D] into cache [B, H, S, D] at positions [B, T]; positions >= S are dropped. (The
    index arrays around the head slice put their broadcast dims first: the update is addressed as [B, T, H, D].)
    Also scales: new [B, T, H] into [B, H, S]."""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, :, positions].set(new.astype(cache.dtype), mode="drop")


SELECT_BLOCKS = 1024  # QSA blocks scored per loop step of a prefill chunk's top-k selection


def reads_filled_part() -> bool:
    """Whether decode and verify (T <= MAX_TOKENS) use the loops whose trip count follows the filled part of the
    cache (`_top_blocks_filled`, `prefill_attention`) rather than the dense forms over all S positions: everywhere
    but on a GPU, where the decode kernel already stops at the filled part and the dense block scoring is one
    batched matmul (a loop there would add a launch per step)."""
    return jax.default_backend() != "gpu"


def _block_scores(q: jax.Array, block_keys: jax.Array) -> jax.Array:
    """The indexer's block scores [B, T, N]: q [B, T, H, d] and block keys [B, N, d], float32."""
    # Heads before blocks: the dot's own output layout (with "btnh" XLA:CPU transposed every score, 5x slower).
    scores = jnp.einsum("bthd,bnd->bthn", q, block_keys)
    return jnp.sum(jax.nn.relu(scores), axis=2) / math.sqrt(q.shape[-1])


def top_block_ids(q: jax.Array, block_keys: jax.Array, n_complete: jax.Array, top: int) -> jax.Array:
    """ids [B, T, top] int32: each token's `top` best-scoring complete blocks (ties to the lower block, as
    `lax.top_k`), scoring only the blocks that are complete for some token of the chunk; NB (the block count) fills
    the slots of a token with fewer than `top` complete blocks.

    A loop over groups of `SELECT_BLOCKS` blocks with a traced trip count keeps a running top-k per token, so a
    prefill chunk's selection costs what the filled part of the cache holds, not its allocated length. The running
    entries come first in each merge and are sorted (value, then block), so a tie goes to the lower block as in one
    `top_k` over all blocks."""
    bsz, t, _, _ = q.shape
    nb = block_keys.shape[1]
    g = min(SELECT_BLOCKS, nb)
    n_steps = (jnp.max(n_complete) + g - 1) // g

    def step(i, carry):
        vals, ids = carry
        # The last group may run past the cache: it is moved back to end there, the blocks already seen masked.
        b0 = jnp.minimum(i * g, nb - g)
        bid = b0 + jnp.arange(g)
        ok = (bid[None, None, :] < n_complete[..., None]) & (bid >= i * g)[None, None, :]
        scores = jnp.where(ok, _block_scores(q, jax.lax.dynamic_slice_in_dim(block_keys, b0, g, axis=1)), -jnp.inf)
        vals, pos = jax.lax.top_k(jnp.concatenate([vals, scores], axis=-1), top)
        cand = jnp.concatenate([ids, jnp.where(ok, bid, nb)], axis=-1)
        return vals, jnp.take_along_axis(cand, pos, axis=-1)

    init = (jnp.full((bsz, t, top), -jnp.inf, jnp.float32), jnp.full((bsz, t, top), nb, jnp.int32))
    _, ids = jax.lax.fori_loop(0, n_steps, step, init)
    return ids


def chosen_from_ids(ids: jax.Array, n_blocks: int) -> jax.Array:
    """The selection mask `chosen` [B, T, n_blocks] of block ids [B, T, top] (n_blocks or more: no block)."""
    bsz, t, _ = ids.shape
    rows = jnp.arange(bsz)[:, None, None], jnp.arange(t)[None, :, None]
    return jnp.zeros((bsz, t, n_blocks), bool).at[rows + (ids,)].set(True, mode="drop")


def _top_blocks_filled(q: jax.Array, block_keys: jax.Array, n_complete: jax.Array, top: int) -> jax.Array:
    """`chosen` [B, T, NB] of `top_block_ids` (with fewer than `top` complete blocks the leftover slots hold no
    block)."""
    return chosen_from_ids(top_block_ids(q, block_keys, n_complete, top), block_keys.shape[1])


class QSAIndexer(nnx.Module):
    """Scores blocks of `compress_ratio` keys and keeps the best `budget / compress_ratio` complete blocks plus the
    incomplete tail; attention then sees only the selected tokens (below `budget` tokens: everything)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.cfg = cfg
        d = cfg.indexer_head_dim
        self.index_qk_proj = Linear(cfg.hidden_size, (cfg.indexer_n_heads + 1) * d, dtype)
        self.q_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)

    def pool_blocks(self, keys: jax.Array, first_block: jax.Array) -> jax.Array:
        """Block keys [B, W, d] from raw index keys [B, W * compress_ratio, d] of blocks first_block[b] .. + W - 1:
        each block's mean key, k_layernorm, RoPE at the block's first position (in the keys' dtype)."""
        cfg = self.cfg
        bsz, n, d = keys.shape
        c = cfg.indexer_compress_ratio
        w = n // c
        pooled = jnp.mean(keys.reshape(bsz, w, c, d).astype(jnp.float32), axis=2).astype(keys.dtype)
        pooled = self.k_layernorm(pooled)
        bcos, bsin = rope_cos_sin((first_block[:, None] + jnp.arange(w)) * c, cfg.rotary_dim, cfg.rope_theta)
        return apply_rope(pooled[:, :, None, :], bcos, bsin)[:, :, 0, :]

    def update_block_keys(
        self, index_k: jax.Array, block_keys: jax.Array, start: jax.Array, n_valid: jax.Array, t: int
    ) -> jax.Array:
        """`block_keys` [B, NB, d] with the blocks that a step's real tokens (n_valid[b] from start[b], index keys
        already in `index_k`) complete pooled anew; the others are left as they were.

        A step of t tokens completes at most (t + c - 1) // c blocks, all from start // c on: that window is read
        from `index_k` whatever the cache length. A block the step leaves incomplete is not written, so a block is
        always pooled from all of its keys, by the step that writes its last one (again if a rollback or a shorter
        length makes it incomplete and later tokens complete it)."""
        c = self.cfg.indexer_compress_ratio
        bsz, nb = block_keys.shape[:2]
        w = min((t + c - 1) // c, nb)
        first = jnp.minimum(start // c, nb - w)  # near the end the window is moved back to fit the cache
        rows = jnp.arange(bsz)[:, None]
        new = self.pool_blocks(index_k[rows, first[:, None] * c + jnp.arange(w * c)], first)
        bid = first[:, None] + jnp.arange(w)
        done = (bid >= (start // c)[:, None]) & ((bid + 1) * c <= (start + n_valid)[:, None])
        return block_keys.at[rows, jnp.where(done, bid, nb)].set(new.astype(block_keys.dtype), mode="drop")

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        n_valid: jax.Array,
        index_k: jax.Array,
        block_keys: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        as_ids: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns the block selection `chosen` [B, T, S // compress_ratio], the updated raw index keys and the
        updated block keys (`update_block_keys`). With `as_ids`, and more blocks in the cache than the budget keeps,
        the selection comes as block ids [B, T, budget // compress_ratio] instead (`top_block_ids`).

        `chosen` marks, per token, the complete blocks (those below (position + 1) // compress_ratio) it sees; the
        incomplete tail block is always seen up to the token's own position (the causal mask bounds it).
        `pallas_kernels.prefill_attention.dense_mask` turns it into the per-token [B, T, S] mask."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        d, c = cfg.indexer_head_dim, cfg.indexer_compress_ratio
        qk = self.index_qk_proj(x)
        q = qk[..., : cfg.indexer_n_heads * d].reshape(bsz, t, cfg.indexer_n_heads, d)
        q = apply_rope(self.q_layernorm(q), cos, sin)
        index_k = _write(index_k, qk[..., cfg.indexer_n_heads * d :], positions)
        block_keys = self.update_block_keys(index_k, block_keys, positions[:, 0], n_valid, t)
        n_blocks = block_keys.shape[1]
        q, keys = q.astype(jnp.float32), block_keys.astype(jnp.float32)
        n_complete = (positions + 1) // c  # [B, T]
        complete = jnp.arange(n_blocks)[None, None, :] < n_complete[..., None]
        top = cfg.indexer_budget // c
        if n_blocks <= top:
            chosen = complete
        elif as_ids:
            chosen = top_block_ids(jax.lax.stop_gradient(q), jax.lax.stop_gradient(keys), n_complete, top)
        elif t > MAX_TOKENS or reads_filled_part():
            # The selection has no gradient; stopping it keeps the loop (no transpose) out of reverse mode.
            chosen = _top_blocks_filled(jax.lax.stop_gradient(q), jax.lax.stop_gradient(keys), n_complete, top)
        else:
            masked = jnp.where(complete, _block_scores(q, keys), -jnp.inf)
            _, best = jax.lax.top_k(masked, top)
            chosen = jnp.zeros(masked.shape, bool).at[
                jnp.arange(bsz)[:, None, None], jnp.arange(t)[None, :, None], best
            ].set(True)
            chosen = chosen & complete
        return chosen, index_k, block_keys


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
        self, x: jax.Array, cache: AttentionCache, start: jax.Array, n_valid: jax.Array
    ) -> tuple[jax.Array, AttentionCache]:
        """x [B, T, H] whose row b's first n_valid[b] tokens are real, at positions from start[b] -> output and the
        advanced cache."""
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
        scales = {}
        if cache.k_scale is not None:
            # Quantized on write, each token's keys and values from their own values (one scale per kv head): the
            # new tokens then attend to their own keys as every later step will see them.
            (k, k_scale), (v, v_scale) = quantize_kv(k, cache.k.dtype), quantize_kv(v, cache.v.dtype)
            scales = dict(k_scale=_write_kv(cache.k_scale, k_scale, positions),
                          v_scale=_write_kv(cache.v_scale, v_scale, positions))
        k_all = _write_kv(cache.k, k, positions)
        v_all = _write_kv(cache.v, v, positions)
        s = k_all.shape[2]

        index_k, block_keys, chosen = cache.index_k, cache.block_keys, None
        c = cfg.indexer_compress_ratio if cfg.qsa else 1
        # A cache of at most the budget's blocks has every complete block chosen: plain causal attention, which
        # cuDNN can take.
        plain = not cfg.qsa or s // c <= cfg.indexer_budget // c
        form = "jnp"
        if t > MAX_TOKENS:
            form = resolve_prefill_impl(cfg.prefill_attention_impl, d, s, not plain, bool(scales), q.dtype,
                                        group=group, compress_ratio=c, cache_elements=bsz * kvh * s * d)
        # Off a GPU, once the cache holds more blocks than the budget keeps, tokens gather their selected keys
        # instead of scoring every position (a 256-token chunk at 34K tokens: ~250x fewer scores); on a GPU the
        # selected-keys kernel does the same for prefill chunks. A prefill kernel asked for by name
        # (ModelConfig.prefill_attention_impl) takes its chunks even so.
        named_kernel = t > MAX_TOKENS and cfg.prefill_attention_impl not in ("auto", "jnp")
        gathered = not plain and (form == "selected" or (not named_kernel and reads_filled_part()))
        if cfg.qsa:
            with jax.named_scope("indexer"):  # its own line in a profile (`bench.profile`): it scores every block
                chosen, index_k, block_keys = self.indexer(x, positions, n_valid, index_k, block_keys, cos, sin,
                                                           as_ids=gathered)

        q = q.reshape(bsz, t, kvh, group, d)
        if gathered and form == "selected":
            out = selected_flash(q, k_all, v_all, start, chosen, c, n_valid,
                                 interpret=jax.default_backend() != "gpu")
        elif gathered:
            out = selected_attention(q, k_all, v_all, start, chosen, c, **scales)
        elif form != "jnp":
            # The flash-style Pallas kernel or cuDNN (ModelConfig.prefill_attention_impl; "auto" picks cuDNN for
            # plain chunks on the GPUs where it was measured, and for chunks with a selection, as its mask, where the
            # selected-keys kernel does not take them).
            out = attend_prefill(q, k_all, v_all, start, chosen=None if plain else chosen, compress_ratio=c,
                                 impl=form, k_new=k, v_new=v, **scales)
        elif t > MAX_TOKENS:
            # Prefill: a loop over the filled key blocks, masks built per block (no [B, T, S] array).
            out = prefill_attention(q, k_all, v_all, start, chosen=chosen, compress_ratio=c, **scales)
        elif reads_filled_part():
            # Decode and verify off a GPU: the same blocked loop, up to each slot's last new token. (The dense form
            # below scores all S positions: at 65,536 it was 118 of a 153 ms demo decode step on the 2-core CPU.)
            out = prefill_attention(q, k_all, v_all, start, chosen=chosen, compress_ratio=c, **scales)
        else:
            # The kernel (on a GPU, for decode and verify) reads each slot's cache only up to its last new token.
            mask = dense_mask(positions, s, chosen, c)  # [B, T, S]: cheap at T <= MAX_TOKENS
            out = decode_attention(q, k_all, v_all, mask, jnp.minimum(start + t, s), **scales)
        out = out.reshape(bsz, t, -1)
        out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out), cache.replace(k=k_all, v=v_all, index_k=index_k, block_keys=block_keys, **scales)
