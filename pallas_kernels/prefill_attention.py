"""Attention of a prefill chunk (T new tokens) over a slot's KV cache, blocked so that its cost follows the filled
part of the cache rather than its allocated length.

`attention_jnp` (pallas_kernels.decode_attention) scores a chunk against all S cache positions through a dense
[B, T, S] mask: at a 65,536-position cache that is ~2 GiB of float32 scores per 2048-token chunk and head group,
whatever the slot holds. Here a loop walks the cache in blocks of ``block_k`` keys and stops after the block that
holds the chunk's last position (a traced trip count: the shapes stay static, the work does not), keeping the
flash-attention online-softmax state (running max, sum and float32 output) per query row. The causal mask and,
for QSA, the per-token block selection are built per key block inside the loop ([B, T, block_k] at a time); a key
block that no token of the chunk sees is skipped.

QSA selection (``chosen`` [B, T, NB], NB = S / compress_ratio, as `strata_jax.model.attention.QSAIndexer` returns
it): token t at position p sees the complete blocks (those below ``(p + 1) // compress_ratio``) that ``chosen``
marks, plus every position of the incomplete tail block up to p. `dense_mask` builds the same rule as a [B, T, S]
mask, for the decode kernel (T <= 16) and as the reference the tests compare against.

Reverse-mode differentiation (the demo trainer runs the attention layer under `jax.grad`) goes through the dense
form: a loop with a traced trip count has no transpose.

A quantized cache (int8 or fp8 keys and values with per-position scales, `pallas_kernels.decode_attention.
quantize_kv`) is read one key block at a time as stored and widened inside the loop; its scales multiply the scores
and the probabilities, as in the decode kernel. It is not differentiated (caches are quantized only for serving).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import attention_jnp, check_kv_scales

BLOCK_K = 512  # keys per loop step: on a CPU, [T x G x Hk x 512] float32 scores per step keep the loop overhead small
_NEG = -1e30  # the running max before any key: finite, so that exp(_NEG - m) is 0 rather than NaN


def dense_mask(positions: jax.Array, s: int, chosen: jax.Array | None = None, compress_ratio: int = 1,
               limit: jax.Array | None = None) -> jax.Array:
    """bool [B, T, S]: which cache positions each token (at ``positions`` [B, T]) sees: those at or before its own
    position, below ``limit`` [B] when given, and with ``chosen`` [B, T, S // compress_ratio] (QSA) only the chosen
    complete blocks plus the incomplete tail."""
    keys = jnp.arange(s)
    mask = keys[None, None, :] <= positions[..., None]
    if limit is not None:
        mask &= keys[None, None, :] < limit[:, None, None]
    if chosen is not None:
        c = compress_ratio
        in_complete = keys[None, None, :] < ((positions + 1) // c * c)[..., None]
        mask &= jnp.where(in_complete, chosen[..., keys // c], True)
    return mask


def _check(q: jax.Array, k: jax.Array, v: jax.Array, chosen: jax.Array | None, compress_ratio: int,
           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> None:
    bsz, t, kv_heads, _, d = q.shape
    s = k.shape[2]
    if k.shape != (bsz, kv_heads, s, d) or v.shape != k.shape:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape} (want q [B, T, Hk, G, D], k "
                         "and v [B, Hk, S, D])")
    check_kv_scales(k, v, k_scale, v_scale)
    if chosen is not None:
        if compress_ratio < 1 or s % compress_ratio:
            raise ValueError(f"the cache length {s} must be a whole number of QSA blocks of {compress_ratio}")
        if chosen.shape != (bsz, t, s // compress_ratio):
            raise ValueError(f"chosen must be [B, T, S // compress_ratio] = {(bsz, t, s // compress_ratio)}, got "
                             f"{chosen.shape}")


def _blocked(q, k, v, start, n_valid, chosen, compress_ratio: int, block_k: int, k_scale=None,
             v_scale=None) -> jax.Array:
    f32 = jnp.float32
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    c = compress_ratio if chosen is not None else 1
    # Whole QSA blocks per key block (the selection is sliced by block); one block when the cache is shorter.
    bk = min(max(c, block_k // c * c), s)
    positions = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    n = jnp.full((bsz,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    limit = jnp.minimum(start.astype(jnp.int32) + n, s)  # [B]: no key at or past it is read
    n_blocks = (jnp.max(limit) + bk - 1) // bk
    tail_start = (positions + 1) // c * c  # [B, T]: first position of each token's incomplete block
    qh = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B, Hk, G, T, D]: the dots batch over (slot, kv head)
    scale = d**-0.5

    def step(i, carry):
        # The last block may run past the cache: it is moved back to end at S, and the keys an earlier block
        # already covered are masked out.
        k0 = jnp.minimum(i * bk, s - bk)
        keys = k0 + jnp.arange(bk)  # [bk]
        see = (keys[None, None, :] <= positions[..., None]) & (keys >= i * bk)[None, None, :]
        see &= (keys[None, :] < limit[:, None])[:, None, :]
        if chosen is not None:
            sel = jnp.repeat(jax.lax.dynamic_slice_in_dim(chosen, k0 // c, bk // c, axis=2), c, axis=2)
            see &= jnp.where(keys[None, None, :] < tail_start[..., None], sel, True)  # [B, T, bk]

        def attend(carry):
            acc, m, total = carry
            kb = jax.lax.dynamic_slice_in_dim(k, k0, bk, axis=2).astype(q.dtype)
            vb = jax.lax.dynamic_slice_in_dim(v, k0, bk, axis=2).astype(q.dtype)
            # Scores rounded to q's dtype by the product, as `attention_jnp` does.
            sc = jnp.einsum("bkgtd,bksd->bkgts", qh, kb).astype(f32) * scale
            if k_scale is not None:
                sc = sc * jax.lax.dynamic_slice_in_dim(k_scale, k0, bk, axis=2)[:, :, None, None, :]
            keep = see[:, None, None]
            sc = jnp.where(keep, sc, _NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.where(keep, jnp.exp(sc - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            pw = p
            if v_scale is not None:
                pw = p * jax.lax.dynamic_slice_in_dim(v_scale, k0, bk, axis=2)[:, :, None, None, :]
            pv = jnp.einsum("bkgts,bksd->bkgtd", pw.astype(q.dtype), vb, preferred_element_type=f32)
            return acc * correction[..., None] + pv, m_new, total * correction + jnp.sum(p, axis=-1)

        # A block no token sees (QSA, or a slot of the batch that ends earlier) costs its mask only.
        return jax.lax.cond(jnp.any(see), attend, lambda c_: c_, carry)

    rows = (bsz, kv_heads, group, t)
    init = (jnp.zeros((*rows, d), f32), jnp.full(rows, _NEG, f32), jnp.zeros(rows, f32))
    acc, _, total = jax.lax.fori_loop(0, n_blocks, step, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _prefill(q, k, v, start, n_valid, chosen, compress_ratio, block_k):
    return _blocked(q, k, v, start, n_valid, chosen, compress_ratio, block_k)


def _prefill_fwd(q, k, v, start, n_valid, chosen, compress_ratio, block_k):
    return _blocked(q, k, v, start, n_valid, chosen, compress_ratio, block_k), (q, k, v, start, n_valid, chosen)


def _prefill_bwd(compress_ratio, block_k, res, g):
    q, k, v, start, n_valid, chosen = res
    t, s = q.shape[1], k.shape[2]
    positions = start[:, None] + jnp.arange(t)[None, :]
    limit = None if n_valid is None else jnp.minimum(start + n_valid, s)
    mask = dense_mask(positions, s, chosen, compress_ratio, limit)
    # A token that sees nothing is 0 here and NaN in the dense form: its rows get no gradient.
    mask_any = jnp.any(mask, axis=-1)
    mask = mask | ~mask_any[..., None]
    g = jnp.where(mask_any[:, :, None, None, None], g, 0)
    _, vjp = jax.vjp(lambda q_, k_, v_: attention_jnp(q_, k_, v_, mask), q, k, v)
    dq, dk, dv = vjp(g)
    return dq, dk, dv, None, None, None


_prefill.defvjp(_prefill_fwd, _prefill_bwd)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, n_valid: jax.Array | None = None,
                      chosen: jax.Array | None = None, compress_ratio: int = 1, *, block_k: int = BLOCK_K,
                      k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """`attention_jnp` of a chunk of T new tokens with the causal (and QSA) mask, reading the cache block by block
    only up to the chunk's last position.

    q [B, T, Hk, G, D]: token t of slot b sits at position ``start[b] + t``; k, v [B, Hk, S, D] the slot caches
    (the chunk's keys and values already written); start [B] int. ``n_valid`` [B] (default T): the chunk's real
    tokens per slot; no key at or past ``start + n_valid`` is read (padding tokens then see only the real ones, a
    slot with none gets zeros). ``chosen`` [B, T, S // compress_ratio] bool: the QSA indexer's complete-block
    selection (module docstring); None: plain causal attention. ``block_k``: keys per loop step (rounded down to
    whole QSA blocks, at most S).

    Returns [B, T, Hk, G, D] in q's dtype: float32 scores and online-softmax state, q's dtype for the operands of
    both products (the dense form rounds the normalised probabilities instead, so bf16 results differ by
    rounding). A token that sees no position gets zeros (the dense form: NaN). A quantized cache (k, v int8 or
    float8_e4m3fn) needs ``k_scale`` and ``v_scale`` [B, Hk, S] float32, and has no gradient."""
    _check(q, k, v, chosen, compress_ratio, k_scale, v_scale)
    if block_k < 1:
        raise ValueError(f"block_k must be positive, got {block_k}")
    if k_scale is not None:
        return _blocked(q, k, v, start.astype(jnp.int32), n_valid, chosen, compress_ratio, block_k,
                        k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    return _prefill(q, k, v, start.astype(jnp.int32), n_valid, chosen, compress_ratio, block_k)
