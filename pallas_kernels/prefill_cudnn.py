"""Prefill attention through `jax.nn.dot_product_attention` (cuDNN's fused flash attention on a GPU), a candidate
beside the Pallas kernel (`pallas_kernels.flash_prefill`) and the jnp form (`pallas_kernels.prefill_attention`).

cuDNN's causal mask, as JAX exposes it, is aligned top-left (query i sees keys j <= i), so a chunk at ``start`` over
a cache holding ``start`` earlier positions cannot be one call without a dense [T, S] mask. It is two calls merged
by their log-sum-exp (`return_residual`):

* the chunk over the cache's prefix (positions below ``start``: ``key_value_seq_lengths = start``, no causal mask),
  the cache transposed to cuDNN's [B, S, Hk, D] layout (a copy of the cache per call; small beside the work at
  agent-sized prefixes);
* the chunk over its own keys and values (the ones just written, [B, T, Hk, D] as computed: no transpose), causal,
  ``key_value_seq_lengths = n_valid``.

A part with no key (an empty prefix, a slot with no real token) gets weight 0.

A chunk with a QSA selection (`cudnn_prefill_selected`) is one call per block of queries over the whole cache: the
selection goes in as cuDNN's attention bias, built from the per-token mask (`prefill_attention.dense_mask`: causal,
the selected complete blocks, the incomplete tail), one [B, 1, block_q, S] mask shared by every head (the selection
is per token, not per head), and ``key_value_seq_lengths`` stops each call's key loop at its last query's position.
Queries go in blocks (`selected_block_q`: 1,024 per slot at S = 65,536, fewer for more slots or longer caches) so
that the mask stays within `MASK_BYTES` and the causal waste inside a call (keys past a query's position are masked,
not skipped) within one block.

Quantized caches are not taken (cuDNN's fp8 attention wants its own scaling); callers fall back to the other forms
there (`pallas_kernels.flash_prefill.attend_prefill`). cuDNN needs bf16 or fp16 operands on a GPU; elsewhere (CPU
tests, float32) JAX's XLA implementation runs the same calls (dense scores: for tests, not for long contexts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.prefill_attention import dense_mask

# Queries per cuDNN call of a selected chunk, at most: its [B, 1, block_q, S] mask (bool, then bf16: 3 bytes per
# entry) is 192 MiB per slot at S = 65,536. Fewer (down to MIN_BLOCK_Q) where B x S would take the mask past
# MASK_BYTES, which stays below what the planner counts for the jnp form's scores (engine/planner.py, `_workspace`).
BLOCK_Q = 1024
MIN_BLOCK_Q = 128
MASK_BYTES = 256 * 2**20


def selected_block_q(bsz: int, s: int) -> int:
    """Queries per call of `cudnn_prefill_selected` for B slots over an S-position cache: the largest power of two
    up to `BLOCK_Q` whose mask fits `MASK_BYTES`, but at least `MIN_BLOCK_Q`."""
    block = BLOCK_Q
    while block > MIN_BLOCK_Q and bsz * block * s * 3 > MASK_BYTES:
        block //= 2
    return block


def cudnn_applies(dtype, quantized: bool) -> bool:
    """Whether `cudnn_prefill` / `cudnn_prefill_selected` would run cuDNN's kernel: bf16 / fp16 operands on a GPU and
    a float cache."""
    return (jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and not quantized)


def cudnn_prefill(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, n_valid: jax.Array | None,
                  k_new: jax.Array, v_new: jax.Array) -> jax.Array:
    """Causal attention of a chunk (no QSA selection, float cache) as `prefill_attention` computes it, through
    `jax.nn.dot_product_attention`: q [B, T, Hk, G, D] at positions ``start[b] + t``; k, v [B, Hk, S, D] the cache
    (only positions below ``start`` are read from it); k_new, v_new [B, T, Hk, D] the chunk's own keys and values
    (the ones written at ``start`` on); ``n_valid`` [B] (default T): real tokens, later ones are not attended to.
    Returns [B, T, Hk, G, D] in q's dtype; a token that sees no position gets zeros.

    ``implementation="cudnn"`` for bf16 / fp16 on a GPU, JAX's default (XLA) otherwise."""
    bsz, t, kv_heads, group, d = q.shape
    if k.shape[:2] != (bsz, kv_heads) or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")
    if k_new.shape != (bsz, t, kv_heads, d) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new and v_new must be [B, T, Hk, D] = {(bsz, t, kv_heads, d)}, got {k_new.shape}, "
                         f"{v_new.shape}")
    dtype = q.dtype
    impl = "cudnn" if cudnn_applies(dtype, False) else None
    start = start.astype(jnp.int32)
    n = jnp.full((bsz,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    qn = q.reshape(bsz, t, kv_heads * group, d)  # head n = kv head n // G, as both conventions have it
    prefix_k = jnp.transpose(k, (0, 2, 1, 3)).astype(dtype)
    prefix_v = jnp.transpose(v, (0, 2, 1, 3)).astype(dtype)
    o1, lse1 = jax.nn.dot_product_attention(qn, prefix_k, prefix_v, key_value_seq_lengths=start, implementation=impl,
                                            return_residual=True)
    # The chunk's keys and values as the cache stores them (a bf16 cache under float32 activations rounds them).
    own_k, own_v = k_new.astype(k.dtype).astype(dtype), v_new.astype(v.dtype).astype(dtype)
    o2, lse2 = jax.nn.dot_product_attention(qn, own_k, own_v, is_causal=True,
                                            key_value_seq_lengths=n, implementation=impl, return_residual=True)
    has1 = (start > 0)[:, None, None]  # [B, 1, 1]: the prefix part saw a key
    has2 = (n > 0)[:, None, None]
    lse1, lse2 = lse1.astype(jnp.float32), lse2.astype(jnp.float32)
    top = jnp.maximum(jnp.where(has1, lse1, -jnp.inf), jnp.where(has2, lse2, -jnp.inf))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w1 = jnp.where(has1, jnp.exp(lse1 - top), 0.0)[..., None]  # [B, T, N, 1]
    w2 = jnp.where(has2, jnp.exp(lse2 - top), 0.0)[..., None]
    total = w1 + w2
    out = (jnp.where(w1 > 0, o1.astype(jnp.float32), 0.0) * w1 + jnp.where(w2 > 0, o2.astype(jnp.float32), 0.0) * w2)
    out = out / jnp.where(total > 0, total, 1.0)
    return out.reshape(bsz, t, kv_heads, group, d).astype(dtype)


def cudnn_prefill_selected(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, n_valid: jax.Array | None,
                           chosen: jax.Array, compress_ratio: int, *, block_q: int | None = None) -> jax.Array:
    """`prefill_attention.prefill_attention` of a chunk with a QSA selection, through
    `jax.nn.dot_product_attention` with the selection as a mask (module docstring): q [B, T, Hk, G, D] at positions
    ``start[b] + t``; k, v [B, Hk, S, D] the cache with the chunk's keys and values already written; ``n_valid`` [B]
    (default T); ``chosen`` [B, T, S // compress_ratio]. Returns [B, T, Hk, G, D] in q's dtype; a token that sees
    no position gets zeros. ``implementation="cudnn"`` for bf16 / fp16 on a GPU, XLA's otherwise (dense scores:
    for tests). ``block_q``: queries per call (default `selected_block_q`)."""
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    if k.shape != (bsz, kv_heads, s, d) or v.shape != k.shape:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")
    block_q = selected_block_q(bsz, s) if block_q is None else block_q
    if compress_ratio < 1 or s % compress_ratio or chosen.shape != (bsz, t, s // compress_ratio):
        raise ValueError(f"chosen must be [B, T, S // compress_ratio] = {(bsz, t, s // max(compress_ratio, 1))} with "
                         f"S a whole number of blocks of {compress_ratio}, got {chosen.shape}")
    if block_q < 1:
        raise ValueError(f"block_q must be positive, got {block_q}")
    dtype = q.dtype
    impl = "cudnn" if cudnn_applies(dtype, False) else None
    start = start.astype(jnp.int32)
    n = jnp.full((bsz,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    keys = jnp.transpose(k, (0, 2, 1, 3)).astype(dtype)  # cuDNN's [B, S, Hk, D]
    values = jnp.transpose(v, (0, 2, 1, 3)).astype(dtype)
    outs = []
    for q0 in range(0, t, block_q):
        tq = min(block_q, t - q0)
        positions = start[:, None] + q0 + jnp.arange(tq)[None, :]
        # No key past this block's last real token (padding tokens see the real ones, as in the other forms).
        limit = jnp.minimum(start + jnp.minimum(n, q0 + tq), s)
        mask = dense_mask(positions, s, chosen[:, q0:q0 + tq], compress_ratio, limit)  # [B, tq, S]
        qn = q[:, q0:q0 + tq].reshape(bsz, tq, kv_heads * group, d)  # head n = kv head n // G
        out = jax.nn.dot_product_attention(qn, keys, values, mask=mask[:, None], key_value_seq_lengths=limit,
                                           implementation=impl)
        # A token that sees no position gets zeros (an all-masked row would average everything).
        outs.append(jnp.where(jnp.any(mask, axis=-1)[..., None, None], out, 0))
    return jnp.concatenate(outs, axis=1).reshape(bsz, t, kv_heads, group, d).astype(dtype)
