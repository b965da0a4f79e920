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

Quantized caches (``KV_QUANT``: int8, or fp8 e4m3): keys and values are stored in one byte with one float32 scale
per (slot, kv head, position) (`quantize_kv`), and both forms take the scales (``k_scale``, ``v_scale`` [B, Hk, S]).
The kernel loads the bytes, widens them to q's dtype in registers (exact: every int8 and e4m3 value is a bf16
value) and applies the scales to the scores and to the probabilities rather than to the [block_k, D] tiles: it
reads half the bytes of a bf16 cache (plus 4 bytes of scale per row of D values), which is the point at long
context.
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


# Quantized KV formats: name -> (storage dtype, largest stored magnitude). One scale per (slot, kv head, position):
# a token's keys and values are quantized when they are written, from their own values alone, so nothing already
# stored is ever requantized, and cutting a cache to a prefix (snapshots, rollback) cuts the scales with it.
# (Per-channel key scales handle outlier channels better but need a group of tokens before quantizing.)
KV_QUANT = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


def is_quantized(dtype) -> bool:
    """Whether a KV cache of `dtype` holds quantized values that need scales (int8 or float8_e4m3fn)."""
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d, _ in KV_QUANT.values())


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] in `dtype` (int8 or float8_e4m3fn), scale [...] float32) with x ~= values *
    scale[..., None]: each row's largest magnitude maps to the format's largest value (127, or 448 for e4m3). A row
    of zeros gets scale 0."""
    found = [(d, m) for d, m in KV_QUANT.values() if jnp.dtype(d) == jnp.dtype(dtype)]
    if not found:
        raise ValueError(f"no quantized KV format stores {jnp.dtype(dtype)} (int8 or float8_e4m3fn)")
    (store, top), = found
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / top
    y = jnp.clip(x * jnp.where(scale > 0, 1.0 / scale, 0.0)[..., None], -top, top)  # rounding may pass `top`
    if jnp.issubdtype(store, jnp.integer):
        y = jnp.round(y)
    return y.astype(store), scale


def dequantize_kv(values: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The inverse of `quantize_kv`: values [..., D] times scale [...], in `dtype`."""
    return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def attention_jnp(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, k_scale: jax.Array | None = None,
                  v_scale: jax.Array | None = None) -> jax.Array:
    """Scaled-dot-product attention of q [B, T, Hk, G, D] over k, v [B, Hk, S, D] where mask [B, T, S] is True:
    [B, T, Hk, G, D] in q's dtype. The scores are rounded to q's dtype by the first product and the probabilities
    before the second, as the model's reference does. A quantized cache passes its scales (k_scale, v_scale
    [B, Hk, S] float32): they multiply the scores and the probabilities (float32), as in the kernel."""
    d = q.shape[-1]
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype)).astype(jnp.float32) * d**-0.5
    if k_scale is not None:
        scores = scores * k_scale[:, :, None, None, :]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    if v_scale is not None:
        probs = probs * v_scale[:, :, None, None, :]
    return jnp.einsum("bkgts,bksd->btkgd", probs.astype(q.dtype), v.astype(q.dtype))


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


def _kernel(len_ref, q_ref, k_ref, v_ref, mask_ref, *refs, kv_heads, tokens, group, ctx, splits, block_k, scale,
            quantized):
    # refs: (k_scale, v_scale,) o, m, l -- the scales only for a quantized cache.
    ks_ref, vs_ref, o_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
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
            if quantized:  # one scale per key: on the [rows, block_k] scores, not the [block_k, D] keys
                s = s * ks_ref[b, h, pl.ds(k0, block_k)][None, :]
            s = jnp.where(keep, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
            correction = jnp.exp(m - m_new)
            values = v_ref[b, h, pl.ds(k0, block_k), :]
            pw = p * vs_ref[b, h, pl.ds(k0, block_k)][None, :] if quantized else p
            pv = jax.lax.dot_general(pw.astype(q.dtype), values.astype(q.dtype), _NN,
                                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
            return acc * correction[:, None] + pv, m_new, total * correction + jnp.sum(p, axis=1)

        # A block no token selects (QSA) costs its mask, not its keys and values.
        return jax.lax.cond(jnp.max(keep.astype(jnp.int32)) > 0, attend, lambda c: c, carry)

    init = (jnp.zeros((rows, d), f32), jnp.full((rows,), _NEG, f32), jnp.zeros((rows,), f32))
    acc, m, total = jax.lax.fori_loop(0, n_blocks, step, init)
    o_ref[b, h, j] = acc
    m_ref[b, h, j] = m
    l_ref[b, h, j] = total


def check_kv_scales(k: jax.Array, v: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None) -> bool:
    """Whether the cache k, v [B, Hk, S, D] is quantized; ValueError unless a quantized cache (int8 or float8_e4m3fn)
    comes with both scales [B, Hk, S] and a float cache with neither."""
    quantized = k_scale is not None
    if quantized != (v_scale is not None) or quantized != is_quantized(k.dtype) or k.dtype != v.dtype:
        raise ValueError(f"a quantized cache (int8 or float8_e4m3fn k and v) takes k_scale and v_scale, a float "
                         f"cache neither: k {k.dtype}, v {v.dtype}, k_scale {k_scale is not None}, v_scale "
                         f"{v_scale is not None}")
    if quantized and (k_scale.shape != k.shape[:3] or v_scale.shape != k.shape[:3]):
        raise ValueError(f"k_scale and v_scale must be [B, Hk, S] = {k.shape[:3]}, got {k_scale.shape} and "
                         f"{v_scale.shape}")
    return quantized


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, lengths: jax.Array, *,
                     k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, impl: str = "auto",
                     splits: int | None = None, block_k: int = BLOCK_K, num_warps: int = 4,
                     interpret: bool = False) -> jax.Array:
    """`attention_jnp` for T <= ``MAX_TOKENS`` new tokens, reading only the filled part of each slot's cache.

    q [B, T, Hk, G, D]; k, v [B, Hk, S, D]; mask [B, T, S] (which positions each token sees: causal and any
    selection); lengths [B] int: no position at or beyond ``lengths[b]`` is read, so every True of ``mask[b]``
    must lie below it. Returns [B, T, Hk, G, D] in q's dtype.

    ``impl``: "jnp", "pallas" or "auto" (``resolve_impl``). ``splits`` defaults to `default_splits`, ``block_k``
    (keys per loop step) to ``BLOCK_K``. The kernel keeps the scores in float32 and rounds the unnormalised
    probabilities to q's dtype for the second product, so it differs from the jnp form by bf16 rounding. A token
    that sees no position gets zeros (the jnp form: NaN). A quantized cache (k, v int8 or float8_e4m3fn) needs
    ``k_scale`` and ``v_scale`` [B, Hk, S] float32 (`quantize_kv`); both forms read its bytes as stored."""
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    if k.shape != (bsz, kv_heads, s, d) or v.shape != k.shape or mask.shape != (bsz, t, s):
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}, mask {mask.shape} (want q "
                         "[B, T, Hk, G, D], k and v [B, Hk, S, D], mask [B, T, S])")
    quantized = check_kv_scales(k, v, k_scale, v_scale)
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quantized else ()
    # Quantized caches too: the kernel's error stays within bf16 rounding (tests/kernels/test_kv_quant.py,
    # `_check_against_float64`; passed on the H200 2026-12-02 16:30 UTC), 5-6x less on average than the jnp form,
    # which rounds the scores to bf16 first.
    if resolve_impl(impl, t, d, s) == "jnp":
        return attention_jnp(q, k, v, mask, *scales)
    if bsz * t * s >= 2**31:  # the kernel addresses the flattened mask with int32 offsets
        if impl == "auto":
            return attention_jnp(q, k, v, mask, *scales)
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
                               block_k=block_k, scale=d**-0.5, quantized=quantized)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=1)}
    part = (bsz, kv_heads, n_split, rows)
    o, m, s_sum = pl.pallas_call(
        kernel,
        grid=(bsz * kv_heads, n_split),
        out_shape=(jax.ShapeDtypeStruct((*part, d), f32), jax.ShapeDtypeStruct(part, f32),
                   jax.ShapeDtypeStruct(part, f32)),
        interpret=interpret,
        **kwargs,
    )(jnp.minimum(lengths.astype(jnp.int32), s), qr, k, v, mask.astype(jnp.int8).reshape(-1), *scales)
    # Merge the splits: a split that saw nothing has a zero sum and m = _NEG, so its weight is 0.
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    total = jnp.sum(s_sum * weight, axis=2)
    out = jnp.sum(o * weight[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    out = out[:, :, : t * group].reshape(bsz, kv_heads, t, group, d)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)
