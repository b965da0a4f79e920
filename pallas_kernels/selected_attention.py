"""QSA attention that reads only the selected keys: a jnp gather form for backends without an attention kernel.

The QSA indexer keeps, per token, its ``top`` best complete blocks of ``compress_ratio`` keys (``budget`` tokens
in all) plus the incomplete tail block up to the token itself (`pallas_kernels.prefill_attention`'s docstring
states the rule; `dense_mask` is its reference). The masked forms (`attention_jnp`, the blocked
`prefill_attention`) still score every cache position up to the chunk's end and throw most scores away: on a CPU a
256-token chunk at 34,000 cached tokens scores ~8.7M (token, position) pairs per head to keep ~34,000. Here each
token gathers its ``top * compress_ratio + compress_ratio`` keys and values (the chosen blocks and the tail) and
attends to those alone, so a chunk's attention costs the same at any context length. The selection itself (scoring
every complete block) still grows with the context, but it reads one pooled key per block.

On a GPU the gathers are scattered reads the decode and flash kernels avoid, so the model uses this form only off
a GPU (`strata_jax.model.attention.reads_filled_part`). Results equal the masked forms up to float32 summation
order: the same keys, the same float32 softmax, the products in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import check_kv_scales


def selected_positions(ids: jax.Array, positions: jax.Array, n_blocks: int, compress_ratio: int,
                       limit: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The cache positions each token reads, and which of them it sees: (pos [B, T, L] int32, see [B, T, L] bool)
    with L = (top + 1) * compress_ratio. ``ids`` [B, T, top]: chosen complete blocks (``n_blocks`` or more: no
    block); ``positions`` [B, T]: each token's own position; ``limit`` [B]: no position at or past it is seen."""
    c = compress_ratio
    offsets = jnp.arange(c, dtype=jnp.int32)
    chosen_ok = ids < n_blocks
    block_pos = jnp.where(chosen_ok, ids, 0)[..., None] * c + offsets  # [B, T, top, c]
    block_see = jnp.broadcast_to(chosen_ok[..., None], block_pos.shape)
    tail_start = (positions + 1) // c * c  # [B, T]
    tail_pos = tail_start[..., None] + offsets  # [B, T, c]
    tail_see = tail_pos <= positions[..., None]
    lead = ids.shape[:2]
    pos = jnp.concatenate([block_pos.reshape(*lead, -1), tail_pos], axis=-1)
    see = jnp.concatenate([block_see.reshape(*lead, -1), tail_see], axis=-1)
    if limit is not None:
        see &= pos < limit[:, None, None]
    # A position that is not seen may lie past the cache (a tail block at its end): read position 0 instead.
    return jnp.where(see, pos, 0).astype(jnp.int32), see


def selected_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, ids: jax.Array,
                       compress_ratio: int, n_valid: jax.Array | None = None, *, k_scale: jax.Array | None = None,
                       v_scale: jax.Array | None = None) -> jax.Array:
    """Attention of T tokens over the keys their QSA selection names.

    q [B, T, Hk, G, D]: token t of slot b at position ``start[b] + t``; k, v [B, Hk, S, D] the caches (the tokens'
    own keys and values already written); ``ids`` [B, T, top] int32 the chosen complete blocks of
    ``compress_ratio`` positions (S // compress_ratio or more: no block), as
    `strata_jax.model.attention.top_block_ids` returns them; ``n_valid`` [B] (default T): real tokens per slot, no
    position at or past ``start + n_valid`` is read. A quantized cache (int8 / fp8) needs ``k_scale`` and
    ``v_scale`` [B, Hk, S] float32. Returns [B, T, Hk, G, D] in q's dtype; a token that sees nothing gets zeros."""
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    if k.shape != (bsz, kv_heads, s, d) or v.shape != k.shape:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape} (want q [B, T, Hk, G, D], k "
                         "and v [B, Hk, S, D])")
    if compress_ratio < 1 or s % compress_ratio:
        raise ValueError(f"the cache length {s} must be a whole number of QSA blocks of {compress_ratio}")
    if ids.ndim != 3 or ids.shape[:2] != (bsz, t):
        raise ValueError(f"ids must be [B, T, top] with B, T = {(bsz, t)}, got {ids.shape}")
    check_kv_scales(k, v, k_scale, v_scale)
    f32 = jnp.float32
    start = start.astype(jnp.int32)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    n = jnp.full((bsz,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    limit = jnp.minimum(start + n, s)
    pos, see = selected_positions(ids, positions, s // compress_ratio, compress_ratio, limit)

    def gather(cache):  # [B, Hk, S, ...] -> [B, Hk, T, L, ...]
        return jax.vmap(lambda c_b, p_b: c_b[:, p_b])(cache, pos)

    kg, vg = gather(k).astype(q.dtype), gather(v).astype(q.dtype)
    # Scores rounded to q's dtype by the product, as the masked forms do.
    sc = jnp.einsum("btkgd,bktld->bkgtl", q, kg).astype(f32) * d**-0.5
    if k_scale is not None:
        sc = sc * gather(k_scale)[:, :, None]
    keep = see[:, None, None]  # [B, 1, 1, T, L]
    sc = jnp.where(keep, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True)
    p = jnp.where(keep, jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if v_scale is not None:
        p = p * gather(v_scale)[:, :, None]
    out = jnp.einsum("bkgtl,bktld->bkgtd", p.astype(q.dtype), vg, preferred_element_type=f32)
    out = out / jnp.where(total > 0, total, 1.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(q.dtype)
