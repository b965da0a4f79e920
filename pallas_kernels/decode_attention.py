"""Attention of a few new tokens over a slot's KV cache (decode and speculative verify), as a Pallas kernel beside
its jnp form.

The jnp form (`attention_jnp`) scores every position of the cache and masks the ones a token may not see: with a
fixed-shape cache of S positions per slot it reads all S keys and values whatever the slot holds, and writes the
[B, Hk, G, T, S] float32 scores through a mask, a softmax and a cast before the second product. At 32 slots of a
4096-token cache half filled, that is twice the KV bytes the step needs plus ~4 passes over the scores per layer
(docs/PERF.md, "Decode attention kernel").

The kernel reads only each slot's filled positions: ``lengths[b]`` (the last position a token of the slot sits at,
plus one) bounds its loop, and a block of keys that no token selects (the QSA indexer's choice, in ``mask``) is
skipped before its keys and values are loaded. Flash-decoding: each (slot, kv head) splits its filled range into
``splits`` equal chunks, one program each; a program keeps the online-softmax state (running max, sum, float32
output) for the T x G query rows that share the kv head (all new tokens at once, so a verify window loads each key
once), and XLA merges the chunks' partial results.

Triton wants power-of-two blocks and dots with M >= 16, so the T x G rows are padded to ``max(16,
next_pow2(T * G))`` (zeros, dropped at the end).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

IMPLS = ("auto", "jnp", "pallas")
MAX_TOKENS = 16  # verify windows and decode; longer prefill chunks go to pallas_kernels.prefill_attention
BLOCK_K = 64  # keys per loop step
TARGET_PROGRAMS = 512  # splits are picked so that (slots x kv heads x splits) reaches about this
_NEG = -1e30  # the running max before any key: finite, so that exp(_NEG - m) is 0 rather than NaN
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def attention_jnp(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Scaled-dot-product attention of q [B, T, Hk, G, D] over k, v [B, Hk, S, D] where mask [B, T, S] is True:
    [B, T, Hk, G, D] in q's dtype. The scores are rounded to q's dtype by the first product and the probabilities
    before the second, as the model's reference does."""
    d = q.shape[-1]
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype)).astype(jnp.float32) * d**-0.5
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", probs, v.astype(q.dtype))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def resolve_impl(impl: str, tokens: int, head_dim: int, ctx: int) -> str:
    """"auto": the Pallas kernel on a GPU for at most ``MAX_TOKENS`` tokens when the head dim is a power of two
    (>= 16) and the cache length a multiple of ``BLOCK_K``; the jnp form otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        ok = (jax.default_backend() == "gpu" and tokens <= MAX_TOKENS and _is_pow2(head_dim) and head_dim >= 16
              and ctx % BLOCK_K == 0)
        return "pallas" if ok else "jnp"
    return impl


def default_splits(slots: int, kv_heads: int) -> int:
    """Chunks per (slot, kv head): the power of two (4 to 32) that brings the programs to about
    ``TARGET_PROGRAMS``: 32 at 1 slot and 8 at 32 slots of Flash-Next's 2 kv heads, the fastest or within 3% of it
    in the H200 sweep (docs/PERF.md, "Decode attention kernel")."""
    return max(4, min(32, _next_pow2(max(1, TARGET_PROGRAMS // (slots * kv_heads)))))


def _kernel(len_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, *, kv_heads, tokens, group, ctx, splits,
            block_k, scale):
    f32 = jnp.float32
    b, h, j = pl.program_id(0) // kv_heads, pl.program_id(0) % kv_heads, pl.program_id(1)
    length = len_ref[b]
    # Every split of a slot takes an equal share of its filled range, in whole blocks.
    chunk = pl.cdiv(pl.cdiv(length, splits), block_k) * block_k
    start = j * chunk
    n_blocks = jnp.maximum(pl.cdiv(jnp.minimum(length, start + chunk) - start, block_k), 0)
    q = q_ref[b, h]  # [rows, D]: token-major (t, g) rows, then zero padding
    rows, d = q.shape
    token = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group, tokens - 1)
    mask_row = (b * tokens + token) * ctx + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [rows, block_k]

    def step(i, carry):
        k0 = start + i * block_k
        keep = mask_ref[mask_row + k0] != 0  # [rows, block_k]: each row's token's mask

        def attend(carry):
            acc, m, total = carry
            keys = k_ref[b, h, pl.ds(k0, block_k), :]
            s = jax.lax.dot_general(q, keys.astype(q.dtype), _NT, precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=f32) * scale
            s = jnp.where(keep, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
            correction = jnp.exp(m - m_new)
            values = v_ref[b, h, pl.ds(k0, block_k), :]
            pv = jax.lax.dot_general(p.astype(q.dtype), values.astype(q.dtype), _NN,
                                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
            return acc * correction[:, None] + pv, m_new, total * correction + jnp.sum(p, axis=1)

        # A block no token selects (QSA) costs its mask, not its keys and values.
        return jax.lax.cond(jnp.max(keep.astype(jnp.int32)) > 0, attend, lambda c: c, carry)

    init = (jnp.zeros((rows, d), f32), jnp.full((rows,), _NEG, f32), jnp.zeros((rows,), f32))
    acc, m, total = jax.lax.fori_loop(0, n_blocks, step, init)
    o_ref[b, h, j] = acc
    m_ref[b, h, j] = m
    l_ref[b, h, j] = total


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, lengths: jax.Array, *,
                     impl: str = "auto", splits: int | None = None, block_k: int = BLOCK_K, num_warps: int = 4,
                     interpret: bool = False) -> jax.Array:
    """`attention_jnp` for T <= ``MAX_TOKENS`` new tokens, reading only the filled part of each slot's cache.

    q [B, T, Hk, G, D]; k, v [B, Hk, S, D]; mask [B, T, S] (which positions each token sees: causal and any
    selection); lengths [B] int: no position at or beyond ``lengths[b]`` is read, so every True of ``mask[b]``
    must lie below it. Returns [B, T, Hk, G, D] in q's dtype.

    ``impl``: "jnp", "pallas" or "auto" (``resolve_impl``). ``splits`` defaults to `default_splits`, ``block_k``
    (keys per loop step) to ``BLOCK_K``. The kernel keeps the scores in float32 and rounds the unnormalised
    probabilities to q's dtype for the second product, so it differs from the jnp form by bf16 rounding. A token
    that sees no position gets zeros (the jnp form: NaN)."""
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    if k.shape != (bsz, kv_heads, s, d) or v.shape != k.shape or mask.shape != (bsz, t, s):
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}, mask {mask.shape} (want q "
                         "[B, T, Hk, G, D], k and v [B, Hk, S, D], mask [B, T, S])")
    if resolve_impl(impl, t, d, s) == "jnp":
        return attention_jnp(q, k, v, mask)
    if bsz * t * s >= 2**31:  # the kernel addresses the flattened mask with int32 offsets
        if impl == "auto":
            return attention_jnp(q, k, v, mask)
        raise ValueError(f"the Pallas decode attention addresses B x T x S = {bsz * t * s} mask entries with int32 "
                         "offsets; fewer slots, tokens or cache positions are needed")
    if not (_is_pow2(d) and d >= 16 and _is_pow2(block_k) and block_k >= 16 and s % block_k == 0):
        raise ValueError(f"the Pallas decode attention needs a power-of-two head dim >= 16 and a power-of-two "
                         f"block_k >= 16 dividing the cache length; got D={d}, block_k={block_k}, S={s}")
    if t > MAX_TOKENS:
        raise ValueError(f"the Pallas decode attention takes at most {MAX_TOKENS} tokens, got {t}")
    f32 = jnp.float32
    n_split = splits or default_splits(bsz, kv_heads)
    # One program serves all T tokens of a (slot, kv head): its T x G query rows share every key and value load.
    rows = max(16, _next_pow2(t * group))
    qr = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(bsz, kv_heads, t * group, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
    kernel = functools.partial(_kernel, kv_heads=kv_heads, tokens=t, group=group, ctx=s, splits=n_split,
                               block_k=block_k, scale=d**-0.5)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=1)}
    part = (bsz, kv_heads, n_split, rows)
    o, m, s_sum = pl.pallas_call(
        kernel,
        grid=(bsz * kv_heads, n_split),
        out_shape=(jax.ShapeDtypeStruct((*part, d), f32), jax.ShapeDtypeStruct(part, f32),
                   jax.ShapeDtypeStruct(part, f32)),
        interpret=interpret,
        **kwargs,
    )(jnp.minimum(lengths.astype(jnp.int32), s), qr, k, v, mask.astype(jnp.int8).reshape(-1))
    # Merge the splits: a split that saw nothing has a zero sum and m = _NEG, so its weight is 0.
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    total = jnp.sum(s_sum * weight, axis=2)
    out = jnp.sum(o * weight[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    out = out[:, :, : t * group].reshape(bsz, kv_heads, t, group, d)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)
