"""Attention of a prefill chunk over a slot's KV cache as a flash-attention Pallas kernel (Triton lowering), the
GPU counterpart of the blocked jnp form in `pallas_kernels.prefill_attention` (same signature, same masks).

The jnp form runs one XLA loop over key blocks for the whole chunk: every step scores all T x G query rows of a
(slot, kv head) against one key block and keeps the [B, Hk, G, T, D] float32 state in memory between steps. Here
each program owns ``block_m`` query rows of one (slot, kv head) and keeps their online-softmax state (running max,
sum, float32 output) in registers across its key blocks, so the scores never leave the chip:

* **Rows.** A kv head's G query heads share its keys (GQA): the chunk's (token, head) pairs are flattened token-major
  into T x G rows and cut into blocks of ``block_m`` (a power of two, so no per-token padding to a power of two: at
  Flash-Next's G = 12 a block holds 5 1/3 tokens). Row r is token r // G.
* **Keys.** A program visits key blocks from position 0 up to its last token's position (and never at or past
  ``start + n_valid``): the blocks wholly below its first token's position (and the limit) without any mask, then
  the rest with the causal mask, the limit, and, for QSA, the per-token block selection (``chosen``; the same rule
  as `prefill_attention.dense_mask`: the chosen complete blocks plus the token's incomplete tail block). A key
  block that no row of the program selects (QSA) is skipped before its keys and values are loaded. Programs of
  later query blocks have more keys; they are launched first.
* **Precision.** bf16 (or the cache's) operands, float32 scores, softmax state and accumulation; the unnormalised
  probabilities are rounded to q's dtype for the second product, as in the decode kernel.
* **Quantized cache** (int8 / fp8 keys and values with per-position scales, `decode_attention.quantize_kv`): the
  bytes are widened in registers and the scales multiply the scores and the probabilities, as in the decode kernel.
* **Unfilled positions.** Values at or past ``start + n_valid`` that share a block with filled ones are zeroed
  before the second product, so whatever a cache holds there (stale or NaN) cannot reach the output.

Block sizes: ``default_blocks(head_dim)`` from ``BLOCKS`` (starting points from the Triton flash-attention
tutorials' settings for these head dims; not yet measured on the H200: docs/PERF.md, "Prefill attention kernel").
The cache length must be at least ``block_k``; the last key block of a cache whose length is not a multiple of
``block_k`` is moved back to end at S (its keys already covered are masked), as in the jnp form.

No gradient: the trainer differentiates the jnp form (`prefill_attention`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.decode_attention import check_kv_scales
from pallas_kernels.prefill_attention import _check, prefill_attention
from pallas_kernels.prefill_cudnn import cudnn_applies, cudnn_prefill, cudnn_prefill_selected
from pallas_kernels.selected_flash import kernel_supports as selected_supports

_NEG = -1e30  # the running max before any key: finite, so that exp(_NEG - m) is 0 rather than NaN
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
    """The kernel's tiling: ``block_m`` query rows (token x head pairs) per program, ``block_k`` keys per loop
    step (powers of two, >= 16), Triton ``num_warps`` and software-pipelining ``num_stages``."""

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_k"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be 1-16 (a power of two) and num_stages >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


# head dim -> tiling. Not yet measured on the H200: the Triton flash-attention tutorial's shapes (D 64 / 128: 128-row
# blocks; D 256, Flash-Next: 64 rows, the [64, 256] float32 accumulator already 64 registers a thread at 8 warps).
BLOCKS = {
    64: PrefillBlocks(block_m=128, block_k=64, num_warps=4, num_stages=2),
    128: PrefillBlocks(block_m=128, block_k=64, num_warps=8, num_stages=2),
    256: PrefillBlocks(block_m=64, block_k=64, num_warps=8, num_stages=2),
}


def default_blocks(head_dim: int) -> PrefillBlocks:
    """The tiling for ``head_dim`` from ``BLOCKS`` (the entry of the nearest head dim at or above it; the largest
    beyond the table)."""
    for d in sorted(BLOCKS):
        if head_dim <= d:
            return BLOCKS[d]
    return BLOCKS[max(BLOCKS)]


def kernel_supports(head_dim: int, ctx: int, blocks: PrefillBlocks | None = None) -> bool:
    """Whether the kernel takes a power-of-two head dim >= 16 and a cache of ``ctx`` positions with this tiling."""
    blocks = blocks or default_blocks(head_dim)
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and ctx >= blocks.block_k


def _kernel(start_ref, limit_ref, q_ref, k_ref, v_ref, *refs, kv_heads, tokens, group, ctx, n_row_blocks, block_m,
            block_k, scale, compress_ratio, n_qsa_blocks, quantized):
    # refs: (chosen,) (k_scale, v_scale,) out -- the selection only with QSA, the scales only for a quantized cache.
    refs = list(refs)
    chosen_ref = refs.pop(0) if compress_ratio else None
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    (o_ref,) = refs
    f32 = jnp.float32
    b, h = pl.program_id(0) // kv_heads, pl.program_id(0) % kv_heads
    j = n_row_blocks - 1 - pl.program_id(1)  # the longest programs (last rows, most keys) start first
    start, limit = start_ref[b], limit_ref[b]
    row0 = j * block_m
    q = q_ref[b, h, pl.ds(row0, block_m), :]  # [block_m, D]
    token = jnp.minimum((row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)) // group, tokens - 1)
    pos = start + token  # [block_m, 1]: each row's position
    first = start + jnp.minimum(row0 // group, tokens - 1)
    last = start + jnp.minimum((row0 + block_m - 1) // group, tokens - 1)
    end = jnp.minimum(last + 1, limit)  # no key at or past it is seen by any row
    # Blocks every row sees whole (causally and under the limit); with QSA every block needs the selection.
    n_free = 0 if compress_ratio else jnp.maximum(jnp.minimum(first + 1, limit), 0) // block_k
    n_all = jnp.maximum(pl.cdiv(end, block_k), n_free)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    if compress_ratio:
        c = compress_ratio
        tail = (pos + 1) // c * c  # [block_m, 1]: the first position of each row's incomplete QSA block
        sel_row = (b * tokens + token) * n_qsa_blocks  # [block_m, 1]

    def attend(k0, keep, carry):
        acc, m, total = carry
        keys = k_ref[b, h, pl.ds(k0, block_k), :]
        values = v_ref[b, h, pl.ds(k0, block_k), :]
        if quantized:
            k_sc, v_sc = ks_ref[b, h, pl.ds(k0, block_k)][None, :], vs_ref[b, h, pl.ds(k0, block_k)][None, :]
        if keep is not None:
            # Stale or NaN values (or value scales) in the unfilled part of a partly filled block would survive
            # p = 0; keys need nothing (their scores are replaced).
            filled = (k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)) < limit
            values = jnp.where(filled, values, jnp.zeros_like(values))
            if quantized:
                v_sc = jnp.where(k0 + lane < limit, v_sc, 0.0)
        s = jax.lax.dot_general(q, keys.astype(q.dtype), _NT, precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=f32) * scale
        if quantized:  # one scale per key: on the [block_m, block_k] scores, not the [block_k, D] keys
            s = s * k_sc
        if keep is not None:
            s = jnp.where(keep, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        if keep is not None:
            p = jnp.where(keep, p, 0.0)
        correction = jnp.exp(m - m_new)
        pw = p * v_sc if quantized else p
        pv = jax.lax.dot_general(pw.astype(q.dtype), values.astype(q.dtype), _NN,
                                 precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
        return acc * correction[:, None] + pv, m_new, total * correction + jnp.sum(p, axis=1)

    def free_step(i, carry):
        return attend(i * block_k, None, carry)

    def masked_step(i, carry):
        # The last block may run past the cache: it is moved back to end at S, the keys already covered masked.
        k0 = jnp.minimum(i * block_k, ctx - block_k)
        keys = k0 + lane  # [1, block_k]
        keep = (keys <= pos) & (keys >= i * block_k) & (keys < limit)  # [block_m, block_k]
        if not compress_ratio:
            return attend(k0, keep, carry)
        chosen = chosen_ref[sel_row + keys // c] != 0
        keep &= jnp.where(keys < tail, chosen, True)
        # A block no row selects costs its mask, not its keys and values.
        return jax.lax.cond(jnp.max(keep.astype(jnp.int32)) > 0, lambda c_: attend(k0, keep, c_), lambda c_: c_,
                            carry)

    d = q.shape[1]
    init = (jnp.zeros((block_m, d), f32), jnp.full((block_m,), _NEG, f32), jnp.zeros((block_m,), f32))
    carry = jax.lax.fori_loop(0, n_free, free_step, init) if not compress_ratio else init
    acc, _, total = jax.lax.fori_loop(n_free, n_all, masked_step, carry)
    # A row that sees no position (a slot with no real token at position 0) gets zeros, as in the jnp form.
    o_ref[b, h, pl.ds(row0, block_m), :] = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(o_ref.dtype)


def flash_prefill(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, n_valid: jax.Array | None = None,
                  chosen: jax.Array | None = None, compress_ratio: int = 1, *, k_scale: jax.Array | None = None,
                  v_scale: jax.Array | None = None, blocks: PrefillBlocks | None = None,
                  interpret: bool = False) -> jax.Array:
    """`pallas_kernels.prefill_attention.prefill_attention` (same arguments, masks and result) as one Pallas
    kernel: q [B, T, Hk, G, D] at positions ``start[b] + t``; k, v [B, Hk, S, D] with the chunk's keys and values
    written; ``n_valid`` [B] real tokens (no key at or past ``start + n_valid`` is read); ``chosen`` [B, T, S //
    compress_ratio] the QSA selection or None (plain causal). Returns [B, T, Hk, G, D] in q's dtype; a token that
    sees no position gets zeros.

    ``blocks``: the tiling (default `default_blocks(D)`); the head dim must be a power of two >= 16 and S at least
    ``blocks.block_k``. ``interpret``: Pallas interpret mode (CPU tests). Not differentiable."""
    _check(q, k, v, chosen, compress_ratio, k_scale, v_scale)
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    blocks = blocks or default_blocks(d)
    if not kernel_supports(d, s, blocks):
        raise ValueError(f"the Pallas prefill attention needs a power-of-two head dim >= 16 and a cache of at least "
                         f"block_k = {blocks.block_k} positions; got D={d}, S={s}")
    quantized = check_kv_scales(k, v, k_scale, v_scale)
    c = compress_ratio if chosen is not None else 0
    nb = s // compress_ratio if chosen is not None else 0
    if chosen is not None and bsz * t * nb >= 2**31:  # the kernel addresses the flattened selection with int32
        raise ValueError(f"the Pallas prefill attention addresses B x T x S / c = {bsz * t * nb} selection entries "
                         "with int32 offsets; fewer slots, tokens or cache positions are needed")
    bm = blocks.block_m
    rows = t * group
    n_row_blocks = pl.cdiv(rows, bm)
    # Token-major (t, g) rows per (slot, kv head), padded with zero rows to whole blocks (dropped at the end).
    qr = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(bsz, kv_heads, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, n_row_blocks * bm - rows), (0, 0)))
    start = start.astype(jnp.int32)
    n = jnp.full((bsz,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    limit = jnp.minimum(start + n, s)
    extra = []
    if chosen is not None:
        extra.append(chosen.astype(jnp.int8).reshape(-1))
    if quantized:
        extra += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    kernel = functools.partial(_kernel, kv_heads=kv_heads, tokens=t, group=group, ctx=s, n_row_blocks=n_row_blocks,
                               block_m=bm, block_k=blocks.block_k, scale=d**-0.5, compress_ratio=c, n_qsa_blocks=nb,
                               quantized=quantized)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                                              num_stages=blocks.num_stages)}
    out = pl.pallas_call(
        kernel,
        grid=(bsz * kv_heads, n_row_blocks),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        interpret=interpret,
        **kwargs,
    )(start, limit, qr, k, v, *extra)
    out = out[:, :, :rows].reshape(bsz, kv_heads, t, group, d)
    return jnp.transpose(out, (0, 2, 1, 3, 4))


PREFILL_IMPLS = ("auto", "jnp", "pallas", "cudnn", "selected")
# Whether "auto" also sends chunks with a QSA selection to cuDNN (`prefill_cudnn.cudnn_prefill_selected`, the
# selection as its attention mask) where it sends plain ones: 1.33-1.54x the jnp form for a 4,096-token chunk after
# 2K-60K cached tokens on an H100, a 20,000-token prefill 1.07x (docs/PERF.md, "Prefill attention").
AUTO_CUDNN_SELECTED = True
# Whether "auto" sends chunks with a QSA selection on a GPU to the kernel that reads only the selected keys
# (`selected_flash`), ahead of cuDNN: a 4,096-token chunk after 2K / 20K / 60K cached tokens 3.46 / 3.49 / 4.00 ms
# per layer against cuDNN's 3.30 / 13.98 / 37.20 on an H100, a 20,000-token prefill 1.872 -> 1.625 s (docs/PERF.md,
# "Prefill attention").
AUTO_SELECTED = True


def auto_takes_cudnn() -> bool:
    """Whether "auto" sends chunks to cuDNN: on Hopper GPUs (compute capability 9.x), where plain chunks measured
    3.7-4.2x the jnp form and 62-98% of the matmul floor at 2K-60K cached tokens, chunks with a QSA selection
    1.33-1.54x (docs/PERF.md, "Prefill attention: cuDNN, measured").
    Other GPUs keep the jnp form until measured (cuDNN's fused attention takes head dim 256 only on some)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def resolve_prefill_impl(impl: str, head_dim: int, ctx: int, selection: bool, quantized: bool, dtype=None, *,
                         group: int = 1, compress_ratio: int = 1, cache_elements: int = 0) -> str:
    """Which form a prefill chunk's attention runs, ``selection`` saying whether it has a QSA selection: "auto" is, on a
    GPU, the selected-keys kernel for chunks with a selection while `AUTO_SELECTED` (where it takes the shapes, the
    queries are 16-bit and the cache is a float one), else cuDNN where `cudnn_applies` (bf16 / fp16, a float cache)
    on a GPU where it was measured (`auto_takes_cudnn`), for chunks with a selection while `AUTO_CUDNN_SELECTED`,
    else the jnp form (the Pallas kernel measured 1.2-1.8x the jnp form on causal chunks, below cuDNN; with a
    selection or a quantized cache it is not yet measured); "pallas" the kernel where it takes the shapes
    (`kernel_supports`); "cudnn" `prefill_cudnn.cudnn_prefill` for plain causal chunks and
    `prefill_cudnn.cudnn_prefill_selected` for chunks with a selection, over a float cache; "selected"
    `selected_flash.selected_flash` for chunks with a selection over a float cache where it takes the shapes
    (``group`` query heads per kv head, QSA blocks of ``compress_ratio``, a cache of ``cache_elements`` = B x Hk x S
    x D), plain chunks as "auto" runs them; the jnp form wherever the choice does not apply. `dtype`: the queries'
    (for "auto"; None: not cuDNN). The selected-keys kernel takes the selection as block ids, which the caller
    (`strata_jax.model.attention`) asks the indexer for when this returns "selected"."""
    if impl not in PREFILL_IMPLS:
        raise ValueError(f"prefill attention impl must be one of {', '.join(PREFILL_IMPLS)}, got {impl!r}")
    takes_selected = selection and not quantized and selected_supports(head_dim, group, compress_ratio,
                                                                         cache_elements=cache_elements)
    if impl == "selected":
        if takes_selected:
            return "selected"
        impl = "auto" if not selection else impl
    if impl == "auto":
        # 16-bit queries only, as measured: float32 dots would run on the FMA units (Precision.HIGHEST).
        sixteen_bit = dtype is not None and jnp.dtype(dtype).itemsize == 2
        if takes_selected and AUTO_SELECTED and sixteen_bit and jax.default_backend() == "gpu":
            return "selected"
        takes = (dtype is not None and cudnn_applies(dtype, quantized) and auto_takes_cudnn()
                 and (not selection or AUTO_CUDNN_SELECTED))
        return "cudnn" if takes else "jnp"
    if impl == "pallas" and kernel_supports(head_dim, ctx):
        return "pallas"
    if impl == "cudnn" and not quantized:
        return "cudnn"
    return "jnp"


def attend_prefill(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, n_valid: jax.Array | None = None,
                   chosen: jax.Array | None = None, compress_ratio: int = 1, *, impl: str = "auto",
                   k_new: jax.Array | None = None, v_new: jax.Array | None = None, k_scale: jax.Array | None = None,
                   v_scale: jax.Array | None = None) -> jax.Array:
    """A prefill chunk's attention by the form ``impl`` picks (`resolve_prefill_impl`); arguments and result as
    `prefill_attention.prefill_attention`. ``k_new``, ``v_new`` [B, T, Hk, D]: the chunk's own keys and values as
    written to the cache, which the cuDNN form of a plain chunk reads instead of the cache (needed for "cudnn"
    without a selection). Off a GPU the kernel runs in Pallas interpret mode (tests) and the cuDNN forms through
    XLA's implementation. The selected-keys kernel takes block ids, not ``chosen``: "selected" runs the chunks
    with a selection in the jnp form here (`strata_jax.model.attention` calls `selected_flash` itself)."""
    quantized = k_scale is not None
    chosen_impl = resolve_prefill_impl(impl, q.shape[-1], k.shape[2], chosen is not None, quantized, q.dtype)
    if chosen_impl == "cudnn" and chosen is None and k_new is None:
        raise ValueError("the cuDNN prefill attention needs the chunk's own keys and values (k_new, v_new)")
    if chosen_impl == "pallas":
        return flash_prefill(q, k, v, start, n_valid, chosen, compress_ratio, k_scale=k_scale, v_scale=v_scale,
                             interpret=jax.default_backend() != "gpu")
    if chosen_impl == "cudnn":
        if chosen is not None:
            return cudnn_prefill_selected(q, k, v, start, n_valid, chosen, compress_ratio)
        return cudnn_prefill(q, k, v, start, n_valid, k_new, v_new)
    return prefill_attention(q, k, v, start, n_valid, chosen, compress_ratio, k_scale=k_scale, v_scale=v_scale)
