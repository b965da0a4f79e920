"""QSA attention of a prefill chunk that reads only each token's selected keys, as one Pallas kernel (Triton
lowering): the GPU counterpart of `pallas_kernels.selected_attention.selected_attention` (its reference: same
arguments, same keys, same result up to float32 summation order, for the slots' real tokens).

Flash-Next's QSA indexer keeps, per token, its ``top`` best complete blocks of ``compress_ratio`` keys (512 blocks
of 4: 2,048 keys) plus its incomplete tail block. The masked forms (cuDNN with the selection as its mask, the
flash kernel, the jnp loop) still score every cached position up to the token, so a 4,096-token chunk after
20,000 cached tokens does ~12x the selection's work (docs/PERF.md, "Prefill attention"). Here:

* **Programs.** One program per (slot, kv head, token): the token's G query heads (GQA) are the rows of its dots,
  padded to ``ROWS`` (16, the tensor cores' smallest M). The grid is flat with tokens fastest, so the programs in
  flight at once belong to one (slot, kv head) and their scattered key reads share the L2 cache (one kv head's
  keys and values at 20,000 positions are 20 MB).
* **Keys.** Each loop step gathers ``block_k`` positions, ``block_k / compress_ratio`` selected blocks, as rows of
  the cache (each row a contiguous D-vector), then runs the two dots and the online softmax in registers. The tail
  block goes first, so a token's live blocks are a prefix of its list and the loop stops after them: a token with
  fewer than ``top`` complete blocks (early in a prompt) costs what it reads.
* **Precision.** The cache's dtype into the dots, float32 scores, softmax state and accumulation; the unnormalised
  probabilities rounded to q's dtype for the second product, as in the other forms.

The ids must be as `strata_jax.model.attention.top_block_ids` returns them: each token's chosen complete blocks
first, then ``S // compress_ratio`` (no block) for the slots it could not fill. Float caches only (an int8 / fp8
cache takes the other forms). Its gradient is the reference's (`jax.custom_vjp`): the demo trainer differentiates
the attention layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.selected_attention import selected_attention

_NEG = -1e30  # the running max before any key: finite, so that exp(_NEG - m) is 0 rather than NaN
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
ROWS = 16  # query rows per program: a token's G heads padded to the tensor cores' smallest tile


@dataclasses.dataclass(frozen=True)
class SelectedBlocks:
    """The kernel's tiling: ``block_k`` gathered positions per loop step (a power of two, >= 16, a multiple of the
    QSA block), Triton ``num_warps`` and ``num_stages``."""

    block_k: int = 32  # H100: 3-5% faster than 64 keys per step at 2K-60K cached tokens
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be 1-16 (a power of two) and num_stages >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


DEFAULT_BLOCKS = SelectedBlocks()


def kernel_supports(head_dim: int, group: int, compress_ratio: int, blocks: SelectedBlocks = DEFAULT_BLOCKS,
                    cache_elements: int = 0) -> bool:
    """Whether the kernel takes these shapes: a power-of-two head dim >= 16, at most ``ROWS`` query heads per kv
    head, QSA blocks that tile ``blocks.block_k`` (a power of two no larger), and a cache of ``cache_elements``
    (B x Hk x S x D) that int32 offsets address."""
    c = compress_ratio
    return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and 1 <= group <= ROWS
            and 1 <= c <= blocks.block_k and c & (c - 1) == 0 and cache_elements < 2**31)


def _kernel(start_ref, limit_ref, ids_ref, q_ref, k_ref, v_ref, o_ref, *, kv_heads, tokens, ctx, n_ids, head_dim,
            block_k, compress_ratio, top, scale):
    f32 = jnp.float32
    c, d = compress_ratio, head_dim
    pid = pl.program_id(0)
    bh, t = pid // tokens, pid % tokens
    b = bh // kv_heads
    start, limit = start_ref[b], limit_ref[b]
    pos = start + t
    q = q_ref[pl.ds(pid * ROWS, ROWS), :]  # [ROWS, D]
    # The tail block, then the chosen ones: only the first 1 + min(top, complete blocks) entries can be live.
    n_live = jnp.where(pos < limit, 1 + jnp.minimum(top, (pos + 1) // c), 0)
    ids_per_step = block_k // c
    n_steps = pl.cdiv(n_live, ids_per_step)
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
    ids_row = (b * tokens + t) * n_ids
    cache_row = bh * ctx

    def step(i, carry):
        acc, m, total = carry
        blk = ids_ref[ids_row + i * ids_per_step + lane // c]  # [block_k]: each position's block id
        key_pos = blk * c + lane % c
        see = (blk * c < ctx) & (key_pos <= pos) & (key_pos < limit)
        rows = cache_row + jnp.where(see, key_pos, 0)
        offsets = rows[:, None] * d + col  # [block_k, D]
        keys = k_ref[offsets]
        # Stale or NaN values at positions not seen would survive p = 0; keys need nothing (their scores are
        # replaced).
        values = jnp.where(see[:, None], v_ref[offsets], jnp.zeros((), v_ref.dtype))
        s = jax.lax.dot_general(q, keys.astype(q.dtype), _NT, precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=f32) * scale
        keep = see[None, :]
        s = jnp.where(keep, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(p.astype(q.dtype), values.astype(q.dtype), _NN,
                                 precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
        return acc * correction[:, None] + pv, m_new, total * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros((ROWS, d), f32), jnp.full((ROWS,), _NEG, f32), jnp.zeros((ROWS,), f32))
    acc, _, total = jax.lax.fori_loop(0, n_steps, step, init)
    # A token past the slot's real tokens runs no step and gets zeros (the reference computes it; the model drops
    # it); so does a token that sees nothing, as in the reference.
    o_ref[pl.ds(pid * ROWS, ROWS), :] = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(o_ref.dtype)


def selected_flash(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, ids: jax.Array, compress_ratio: int,
                   n_valid: jax.Array | None = None, *, blocks: SelectedBlocks = DEFAULT_BLOCKS,
                   interpret: bool = False) -> jax.Array:
    """`selected_attention.selected_attention` (float caches) as one Pallas kernel: q [B, T, Hk, G, D] at positions
    ``start[b] + t``; k, v [B, Hk, S, D] with the chunk's keys and values written; ``ids`` [B, T, top] int32 the
    chosen complete blocks as `top_block_ids` returns them (live ids first; S // compress_ratio: no block);
    ``n_valid`` [B] real tokens (no position at or past ``start + n_valid`` is read). Returns [B, T, Hk, G, D] in q's
    dtype; a token that sees nothing gets zeros, and so does a token past ``n_valid`` (where the reference attends
    to the slot's real positions: the model drops those rows). ``interpret``: Pallas interpret mode (CPU tests).
    Differentiable in q, k and v through the reference."""
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    c = compress_ratio
    if k.shape != (bsz, kv_heads, s, d) or v.shape != k.shape:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape} (want q [B, T, Hk, G, D], k "
                         "and v [B, Hk, S, D])")
    if not kernel_supports(d, group, c, blocks, bsz * kv_heads * s * d):
        raise ValueError(f"the selected-keys kernel needs a power-of-two head dim >= 16, at most {ROWS} query heads "
                         f"per kv head, a power-of-two QSA block <= block_k = {blocks.block_k} and fewer than 2**31 "
                         f"cache elements (int32 offsets); got D={d}, G={group}, compress_ratio={c}, B x Hk x S x D = "
                         f"{bsz * kv_heads * s * d}")
    if c < 1 or s % c:
        raise ValueError(f"the cache length {s} must be a whole number of QSA blocks of {c}")
    if ids.ndim != 3 or ids.shape[:2] != (bsz, t):
        raise ValueError(f"ids must be [B, T, top] with B, T = {(bsz, t)}, got {ids.shape}")
    if not (jnp.issubdtype(k.dtype, jnp.floating) and jnp.issubdtype(v.dtype, jnp.floating)):
        raise ValueError(f"the selected-keys kernel reads float caches; got {k.dtype} (a quantized cache takes the "
                         "jnp form)")
    start = start.astype(jnp.int32)
    n = jnp.full((bsz,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    return _selected(q, k, v, start, ids.astype(jnp.int32), n, c, blocks, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _selected(q, k, v, start, ids, n, c, blocks, interpret):
    return _call(q, k, v, start, ids, n, c, blocks, interpret)


def _selected_fwd(q, k, v, start, ids, n, c, blocks, interpret):
    return _call(q, k, v, start, ids, n, c, blocks, interpret), (q, k, v, start, ids, n)


def _selected_bwd(c, blocks, interpret, res, g):
    """The gradient through the reference (the demo trainer differentiates the attention layer), with the rows the
    kernel zeroes (tokens past n_valid) given none."""
    q, k, v, start, ids, n = res
    real = (jnp.arange(q.shape[1])[None, :] < n[:, None])[:, :, None, None, None]
    _, vjp = jax.vjp(lambda q_, k_, v_: selected_attention(q_, k_, v_, start, ids, c, n), q, k, v)
    return (*vjp(jnp.where(real, g, jnp.zeros_like(g))), None, None, None)


_selected.defvjp(_selected_fwd, _selected_bwd)


def _call(q, k, v, start, ids, n, c, blocks, interpret):
    bsz, t, kv_heads, group, d = q.shape
    s = k.shape[2]
    nb = s // c
    top = ids.shape[2]
    ids_per_step = blocks.block_k // c
    n_ids = pl.cdiv(top + 1, ids_per_step) * ids_per_step
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    limit = jnp.minimum(start + n, s)
    # [tail, chosen..., padding]: the tail block id may be nb (a token at the cache's last position): never seen.
    tail = jnp.minimum((positions + 1) // c, nb)[..., None]
    pad = jnp.full((bsz, t, n_ids - top - 1), nb, jnp.int32)
    ids_ext = jnp.concatenate([tail, jnp.minimum(ids, nb), pad], axis=-1).reshape(-1)
    # Rows (slot, kv head, token, head), each token's G heads padded to ROWS.
    qr = jnp.transpose(q, (0, 2, 1, 3, 4))
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, ROWS - group), (0, 0))).reshape(-1, d)
    kernel = functools.partial(_kernel, kv_heads=kv_heads, tokens=t, ctx=s, n_ids=n_ids, head_dim=d,
                               block_k=blocks.block_k, compress_ratio=c, top=top, scale=d**-0.5)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                                              num_stages=blocks.num_stages)}
    out = pl.pallas_call(
        kernel,
        grid=(bsz * kv_heads * t,),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        interpret=interpret,
        **kwargs,
    )(start, limit, ids_ext, qr, k.reshape(-1), v.reshape(-1))
    out = out.reshape(bsz, kv_heads, t, ROWS, d)[:, :, :, :group]
    return jnp.transpose(out, (0, 2, 1, 3, 4))
