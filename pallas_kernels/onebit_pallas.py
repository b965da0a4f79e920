"""Pallas kernels (Triton lowering) for the routed-expert MoE on packed 1-bit weights.

Two kernels per MoE layer:

* ``gate_up``: for a block of rows routed to one expert and a tile of ``bn`` intermediate columns,
  computes ``silu(x @ gate^T) * (x @ up^T)`` -- gate and up tiles in the same program, so the
  activation is fused and x is read once for both.
* ``down``: ``h @ down^T`` for the same rows, either fused with the weighted sum over the k experts
  of a token (``pairs`` schedule: one program per (token, column tile) loops over the token's k
  experts and writes the output once, no atomics, no extra pass) or per expert block with a masked
  store of per-pair rows that one small XLA gather+sum combines (``grouped`` schedule).

Schedules:

* ``pairs``: one block per (token, slot) pair, in routing order; nothing to prepare, 2 launches.
  Reads an expert once per pair that uses it (no de-duplication across tokens): best for decode.
* ``grouped``: pairs sorted by expert (XLA argsort + a few tiny fusions), blocks of up to ``bm`` rows
  of one expert, so each distinct expert's bits are read and unpacked once per block.

Every program reads only its expert's words: the expert id is a scalar loaded from the routing
table at the start of the program (the Triton lowering has no scalar-prefetch grid spec; a scalar
load + dynamic indexing of the whole-array ref gives the same effect) and selects the base pointer.

Unpacking: a tile of ``bkw`` words x ``bn`` outputs becomes ``32*bkw`` x ``bn`` signed scales by a
shift and an and/xor per element (``unpack="xor"``: the inverted bit is shifted into the float32
sign position and xored onto the bit pattern of the scale) or a compare/select (``"select"``);
then one ``jnp.dot`` with the matching ``[bm, 32*bkw]`` slice of x (bf16 operands, f32
accumulation). ``compute="vpu"`` replaces the dot with f32 FMAs (pairs schedule only).

Measured on an H200 with chained layers (docs/PERF.md, "1-bit MoE kernel"): 49 us per layer at T = 1 (pairs),
153 us at T = 8 and 575 us at T = 64 (grouped), 5-15% of the memory floor, bound by the instructions spent per
weight (unpack, convert, the operand's trip through shared memory; an int8 operand did not help). The lookup-table
kernels of ``onebit_lut`` (``compute="lut"``) spend ~1.5 instructions per weight instead and are 1.6-2.3x faster
up to T = 64; ``default_config(T)`` picks them up to T = 128 and the grouped MMA schedule beyond (prefill chunks).

Triton constraints honoured here (interpret mode does not check them): all block shapes are powers
of two; dot operands are >= 16 in every dimension (bm >= 16, bn >= 16, K step = 32*bkw >= 32); both
dot operands have the same dtype (bf16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.activations import silu
from pallas_kernels.onebit_common import launch, strip_poison
from pallas_kernels.onebit_format import WORD_BITS, PackedExperts
from pallas_kernels.onebit_lut import down_lut, gate_up_lut, nibble_tables, pair_blocks


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    schedule: str = "auto"  # "pairs" | "grouped" | "auto"
    pairs_max_tokens: int = 8  # auto: pairs schedule when T <= this
    bm: int = 16  # rows per block (dot M; >= 16 for the Triton dot)
    bn1: int = 32  # gate_up: intermediate columns per program
    bkw1: int = 4  # gate_up: packed words per K step (K step = 32 * bkw1 inputs)
    bn2: int = 32  # down: hidden columns per program
    bkw2: int = 4  # down: packed words per K step
    num_warps: int = 4
    num_stages: int = 3
    # "mma" | "mma2d" (bf16 jnp.dot) | "mma_tf32" (the unpacked float32 tile straight into a TF32 dot: no
    # float32 -> bf16 conversion per weight) | "mma_i8" (int8 dot of +-1 signs with the activations quantised per
    # row and scale group; the scales applied per K step: half the bf16 tile's bytes) | "mma_t" (as "mma" with the
    # unpacked weights as the dot's left operand, [bn, bm] accumulators) | "vpu" | "vpu2d" (f32 FMA;
    # pairs only) | "lut" (no dot: nibble lookup tables of the activations, onebit_lut; either schedule)
    compute: str = "mma"
    # "xor" | "select" | "xor16" (xor, then the bf16 operand taken as the float32's high half by a shift: exact,
    # since the scales are bf16, and no conversion instruction; 1 plane, compute="mma" or "mma_t" only)
    unpack: str = "xor"
    # pairs: one down program per (pair, column block), partial sums added by XLA, instead of one per (token,
    # column block) walking its k experts in turn (at T = 1: 10x the programs, 1/10 of the serial loads each).
    split_pairs: bool = False
    # compute="lut": dtype of the activations' nibble tables ("float32" or "bfloat16": half the table traffic)
    lut_table: str = "float32"
    # compute="lut": programs per gate_up column tile along K (partial sums added by XLA before the activation)
    lut_ksplit: int = 1
    # compute="lut": index width of the tables, 4 (16 entries per 4 inputs) or 8 (256 entries per 8 inputs)
    lut_bits: int = 4
    # compute="lut": the K steps written out in line instead of a loop
    lut_unroll: bool = False
    # compute="lut": packed words loaded with the evict-first cache hint (jax 0.10.2's ".cg" modifier does not lower),
    # so that the streamed weights do not push the tables out of L1
    lut_stream: bool = False


DEFAULT_CONFIG = KernelConfig()
# Measured on an H200 with chained layers (docs/PERF.md, "1-bit MoE kernel", sweep of 2026-11-29 20:15 UTC): the
# pairs schedule with one down program per pair and 2 warps is best up to T = 4 (1.7x the walking down kernel at
# T = 1-2), the grouped schedule with 128-column tiles and 4 warps from T = 8 (2-4% over 64 columns, 2 warps).
DEFAULT_PAIRS = KernelConfig(schedule="pairs", bn1=32, bkw1=4, bn2=32, bkw2=4, num_warps=2, split_pairs=True)
DEFAULT_GROUPED = KernelConfig(schedule="grouped", bn1=128, bkw1=4, bn2=128, bkw2=4, num_warps=4)
PAIRS_MAX_TOKENS = 4
# The lookup-table kernels (onebit_lut) on the pairs schedule, gate_up's K range split over 5 programs: 1.6-2.3x the
# MMA kernels from T = 1 to 64 (docs/PERF.md, "Lookup-table kernels"). Narrow tiles and float32 tables up to T = 4;
# from T = 8 wider tiles and bf16 tables (3-4% faster at T >= 32, and 2 planes then grow no more than the bytes). The
# grouped MMA kernel wins again between T = 128 and 256, where an expert's block has enough rows to fill the dot.
DEFAULT_LUT = KernelConfig(schedule="pairs", compute="lut", bn1=32, bkw1=8, bn2=32, bkw2=8, num_warps=4, lut_ksplit=5)
DEFAULT_LUT_WIDE = KernelConfig(schedule="pairs", compute="lut", bn1=64, bkw1=8, bn2=128, bkw2=8, num_warps=4,
                                lut_ksplit=5, lut_table="bfloat16")
LUT_NARROW_MAX_TOKENS = 4
LUT_MAX_TOKENS = 128
# Prefill chunks: blocks of 64 rows (T >= PREFILL_MIN_TOKENS gives ~20-80 rows per expert at top-10 of 512), so that
# an expert's bits are unpacked about once per chunk instead of once per 16 rows, and the bf16 operand taken as the
# high half of the float32 sign-xored scale. H200 sweep of `bench.kernels` (docs/PERF.md, "1-bit experts at prefill
# sizes", 2026-12-01): 1268 us per layer at T = 2048 (24% of the compute floor) against 2342 for DEFAULT_GROUPED and
# 2397 for bf16 experts; 2264 against 4155 at T = 4096; at T = 512 DEFAULT_GROUPED stays ahead (889 against 1162).
# Two pipeline stages, not three (H100, 2026-12-07 22:07 UTC, docs/perf-log.md "Device session of 2026-12-07, sixth"):
# 72 instead of 94 KB of shared memory per program lets three programs share an SM (18.75% occupancy against 12.5%);
# the layer 2,343 against 2,463 us at T = 4,096 and 6,471 against 6,634 at 16,384, all of it in the down kernel.
DEFAULT_PREFILL = KernelConfig(schedule="grouped", bm=64, bn1=128, bkw1=4, bn2=128, bkw2=4, num_warps=4,
                               num_stages=2, unpack="xor16")
PREFILL_MIN_TOKENS = 1024


def default_config(tokens: int) -> KernelConfig:
    """The measured-best kernel configuration for a batch of ``tokens`` rows (H200, Flash-Next shapes)."""
    if tokens <= LUT_NARROW_MAX_TOKENS:
        return DEFAULT_LUT
    if tokens <= LUT_MAX_TOKENS:
        return DEFAULT_LUT_WIDE
    return DEFAULT_GROUPED if tokens < PREFILL_MIN_TOKENS else DEFAULT_PREFILL


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _signed_scales(words, sc, unpack: str):
    """words uint32 [bkw, bn], sc float32 [bkw, bn] -> float32 [bkw, 32, bn]: bit j of word ? +sc : -sc."""
    j = lax.broadcasted_iota(jnp.uint32, (1, WORD_BITS, 1), 1)
    if unpack == "xor":
        neg = (~words)[:, None, :] << (jnp.uint32(WORD_BITS - 1) - j)  # bit j of ~word -> bit 31
        sgn = neg & jnp.uint32(0x80000000)
        v = lax.bitcast_convert_type(sc, jnp.uint32)[:, None, :] ^ sgn
        return lax.bitcast_convert_type(v, jnp.float32)
    if unpack == "select":
        bit = (words[:, None, :] >> j) & jnp.uint32(1)
        return jnp.where(bit != 0, sc[:, None, :], -sc[:, None, :])
    raise ValueError(f"unknown unpack {unpack!r}")


def _tile_values(bits_ref, sc_ref, e, w0, n0, *, planes, bkw, bn, wpg, unpack):
    """Sum over planes of the signed scales of a [32*bkw, bn] weight tile ([bkw, 32, bn]; float32, or bf16 for
    ``unpack="xor16"`` with one plane)."""
    gidx = lax.div(w0 + lax.broadcasted_iota(jnp.int32, (bkw,), 0), jnp.int32(wpg))
    v = None
    for p in range(planes):
        words = bits_ref[e, p, pl.ds(w0, bkw), pl.ds(n0, bn)]
        sc = sc_ref[e, p, gidx, pl.ds(n0, bn)].astype(jnp.float32)
        vp = _signed_scales(words, sc, "xor" if unpack == "xor16" else unpack)
        v = vp if v is None else v + vp
    return _high_bf16(v) if unpack == "xor16" and planes == 1 else v


def _high_bf16(v):
    """float32 values whose low 16 bits are zero (sign-xored bf16 scales) -> the same values as bf16, by a shift."""
    hi = lax.convert_element_type(lax.bitcast_convert_type(v, jnp.uint32) >> jnp.uint32(16), jnp.uint16)
    return lax.bitcast_convert_type(hi, jnp.bfloat16)


def _tile_values_t(bits_ref, sc_ref, e, w0, n0, *, planes, bkw, bn, wpg, unpack):
    """`_tile_values` transposed, unpacked in that layout: [bn, 32*bkw] (the weight tile as a dot's left operand,
    which Hopper's wgmma may take from registers, where a right operand goes through shared memory)."""
    gidx = lax.div(w0 + lax.broadcasted_iota(jnp.int32, (bkw,), 0), jnp.int32(wpg))
    j = lax.broadcasted_iota(jnp.uint32, (1, 1, WORD_BITS), 2)
    v = None
    for p in range(planes):
        words = bits_ref[e, p, pl.ds(w0, bkw), pl.ds(n0, bn)].T
        sc = sc_ref[e, p, gidx, pl.ds(n0, bn)].astype(jnp.float32).T
        sgn = ((~words)[:, :, None] << (jnp.uint32(WORD_BITS - 1) - j)) & jnp.uint32(0x80000000)
        vp = lax.bitcast_convert_type(lax.bitcast_convert_type(sc, jnp.uint32)[:, :, None] ^ sgn, jnp.float32)
        v = vp if v is None else v + vp
    if unpack == "xor16" and planes == 1:
        v = _high_bf16(v)
    return v.reshape(bn, bkw * WORD_BITS)


def _word_values(bits_ref, sc_ref, e, w, n0, *, planes, bn, wpg):
    """One packed word row -> float32 [32, bn]: row j = +-scale by bit j (2-D, no reshape)."""
    sh = jnp.uint32(WORD_BITS - 1) - lax.broadcasted_iota(jnp.uint32, (WORD_BITS, 1), 0)
    g = lax.div(w, jnp.int32(wpg))
    v = None
    for p in range(planes):
        word = bits_ref[e, p, w, pl.ds(n0, bn)]
        sc = sc_ref[e, p, g, pl.ds(n0, bn)].astype(jnp.float32)
        sgn = ((~word)[None, :] << sh) & jnp.uint32(0x80000000)
        vp = lax.bitcast_convert_type(lax.bitcast_convert_type(sc, jnp.uint32)[None, :] ^ sgn, jnp.float32)
        v = vp if v is None else v + vp
    return v


def _row0(acc, bm):
    rows = lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    return jnp.sum(jnp.where(rows == 0, acc, 0.0), axis=0)


def _signs_i8(words):
    """words uint32 [bkw, bn] -> int8 [32*bkw, bn]: +1 where bit j of a word is set, else -1."""
    j = lax.broadcasted_iota(jnp.uint32, (1, WORD_BITS, 1), 1)
    bit = ((words[:, None, :] >> j) & jnp.uint32(1)).astype(jnp.int32)
    return (2 * bit - 1).astype(jnp.int8).reshape(words.shape[0] * WORD_BITS, words.shape[1])


def _mma_loop(load_x, bits_ref, sc_ref, e, n0s, *, n_steps, bm, bn, bkw, planes, wpg, unpack, compute, load_sx=None):
    """sum over K of x @ W^T for len(n0s) column tiles of one expert: [bm, bn] float32 each.

    compute="mma": a [bkw, 32, bn] unpack reshaped to one [32*bkw, bn] dot operand per step;
    compute="mma2d": one [32, bn] operand per word (2-D throughout, K = 32 per dot);
    compute="mma_t": the same products as "mma" with the operands swapped (the unpacked weights on the left,
    `_tile_values_t`): [bn, bm] accumulators, transposed once at the end;
    compute="mma_i8": x is int8 (quantised per row and scale group, `load_sx(g)` -> [bm, 1] its scales), one int8
    dot per plane against the +-1 signs, times both scales (a K step never crosses a scale group).
    """
    tile = functools.partial(_tile_values, bits_ref, sc_ref, planes=planes, bkw=bkw, bn=bn, wpg=wpg, unpack=unpack)
    tile_t = functools.partial(_tile_values_t, bits_ref, sc_ref, planes=planes, bkw=bkw, bn=bn, wpg=wpg,
                               unpack=unpack)
    word = functools.partial(_word_values, bits_ref, sc_ref, planes=planes, bn=bn, wpg=wpg)

    def body(it, accs):
        w0 = it * bkw
        accs = list(accs)
        if compute == "mma_i8":
            xt = load_x(w0 * WORD_BITS, bkw * WORD_BITS)
            g = lax.div(w0, jnp.int32(wpg))
            sx = load_sx(g).astype(jnp.float32)
            for c, n0 in enumerate(n0s):
                for p in range(planes):
                    d = jnp.dot(xt, _signs_i8(bits_ref[e, p, pl.ds(w0, bkw), pl.ds(n0, bn)]),
                                preferred_element_type=jnp.int32)
                    sc = sc_ref[e, p, g, pl.ds(n0, bn)].astype(jnp.float32)
                    accs[c] = accs[c] + d.astype(jnp.float32) * sx * sc[None, :]
        elif compute == "mma_t":
            xt = load_x(w0 * WORD_BITS, bkw * WORD_BITS).astype(jnp.bfloat16).T
            for c, n0 in enumerate(n0s):
                v = tile_t(e, w0, n0).astype(jnp.bfloat16)
                accs[c] = accs[c] + jnp.dot(v, xt, preferred_element_type=jnp.float32)
        elif compute in ("mma", "mma_tf32"):
            # Pallas' Triton lowering runs a float32 x float32 dot at its default precision as TF32.
            dt = jnp.float32 if compute == "mma_tf32" else jnp.bfloat16
            xt = load_x(w0 * WORD_BITS, bkw * WORD_BITS).astype(dt)
            for c, n0 in enumerate(n0s):
                v = tile(e, w0, n0).reshape(bkw * WORD_BITS, bn).astype(dt)
                accs[c] = accs[c] + jnp.dot(xt, v, preferred_element_type=jnp.float32)
        else:
            for i in range(bkw):
                xt = load_x((w0 + i) * WORD_BITS, WORD_BITS).astype(jnp.bfloat16)
                for c, n0 in enumerate(n0s):
                    v = word(e, w0 + i, n0).astype(jnp.bfloat16)
                    accs[c] = accs[c] + jnp.dot(xt, v, preferred_element_type=jnp.float32)
        return tuple(accs)

    if compute == "mma_t":
        z = jnp.zeros((bn, bm), jnp.float32)
        return tuple(a.T for a in lax.fori_loop(0, n_steps, body, tuple(z for _ in n0s)))
    z = jnp.zeros((bm, bn), jnp.float32)
    return lax.fori_loop(0, n_steps, body, tuple(z for _ in n0s))


def _vpu_loop(load_xrow, bits_ref, sc_ref, e, n0s, *, n_steps, bn, bkw, planes, wpg, unpack, compute):
    """One row: sum over K of x * W^T with float32 FMAs -> [bn] per column tile (no dot)."""
    tile = functools.partial(_tile_values, bits_ref, sc_ref, planes=planes, bkw=bkw, bn=bn, wpg=wpg, unpack=unpack)
    word = functools.partial(_word_values, bits_ref, sc_ref, planes=planes, bn=bn, wpg=wpg)

    def body(it, accs):
        w0 = it * bkw
        accs = list(accs)
        if compute == "vpu":
            x3 = load_xrow(w0 * WORD_BITS, bkw * WORD_BITS).astype(jnp.float32).reshape(bkw, WORD_BITS, 1)
            for c, n0 in enumerate(n0s):
                accs[c] = accs[c] + x3 * tile(e, w0, n0)
        else:
            for i in range(bkw):
                xc = load_xrow((w0 + i) * WORD_BITS, WORD_BITS).astype(jnp.float32)[:, None]
                for c, n0 in enumerate(n0s):
                    accs[c] = accs[c] + xc * word(e, w0 + i, n0)
        return tuple(accs)

    shape = (bkw, WORD_BITS, bn) if compute == "vpu" else (WORD_BITS, bn)
    z = jnp.zeros(shape, jnp.float32)
    accs = lax.fori_loop(0, n_steps, body, tuple(z for _ in n0s))
    out = []
    for a in accs:
        while a.ndim > 1:
            a = jnp.sum(a, axis=0)
        out.append(a)
    return out


# --------------------------------------------------------------------------------------------------
# kernel bodies


def _gate_up_kernel(*refs, grouped, k, cfg: KernelConfig, kw_total, wpg, planes, inter, poison):
    refs = strip_poison(refs, poison)
    quant = cfg.compute == "mma_i8"
    if grouped:
        blk_e_ref, blk_pos_ref, blk_n_ref, tok_ref, x_ref, *rest = refs
    else:
        ids_ref, x_ref, *rest = refs
    sx_ref, bits_ref, sc_ref, h_ref = rest if quant else (None, *rest)
    bm, bn, bkw = cfg.bm, cfg.bn1, cfg.bkw1
    b = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    common = dict(n_steps=kw_total // bkw, bn=bn, bkw=bkw, planes=planes, wpg=wpg, unpack=cfg.unpack,
                  compute=cfg.compute)

    if grouped:
        e = blk_e_ref[b]
        pos0 = blk_pos_ref[b]
        nvalid = blk_n_ref[b]

        @pl.when(e >= 0)
        def _():
            rows = tok_ref[pl.ds(pos0, bm)]

            def load_x(k0, kk):
                return x_ref[rows, pl.ds(k0, kk)]

            load_sx = (lambda g: sx_ref[rows, pl.ds(g, 1)]) if quant else None
            acc_g, acc_u = _mma_loop(load_x, bits_ref, sc_ref, e, (n0, n0 + inter), bm=bm, load_sx=load_sx, **common)
            hval = silu(acc_g) * acc_u
            rmask = lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < nvalid
            pltriton.store(h_ref.at[pl.ds(pos0, bm), pl.ds(n0, bn)], hval.astype(h_ref.dtype), mask=rmask)

        return

    e = ids_ref[b]
    t = lax.div(b, jnp.int32(k))
    if cfg.compute in ("vpu", "vpu2d"):
        def load_xrow(k0, kk):
            return x_ref[t, pl.ds(k0, kk)]

        g, u = _vpu_loop(load_xrow, bits_ref, sc_ref, e, (n0, n0 + inter), **common)
        h_ref[b, pl.ds(n0, bn)] = (silu(g) * u).astype(h_ref.dtype)
        return
    rows = jnp.full((bm,), t, jnp.int32)

    def load_x(k0, kk):
        return x_ref[rows, pl.ds(k0, kk)]

    load_sx = (lambda g: sx_ref[rows, pl.ds(g, 1)]) if quant else None
    acc_g, acc_u = _mma_loop(load_x, bits_ref, sc_ref, e, (n0, n0 + inter), bm=bm, load_sx=load_sx, **common)
    h_ref[b, pl.ds(n0, bn)] = _row0(silu(acc_g) * acc_u, bm).astype(h_ref.dtype)


def _down_tok_kernel(*refs, k, cfg: KernelConfig, kw_total, wpg, planes, poison):
    refs = strip_poison(refs, poison)
    quant = cfg.compute == "mma_i8"
    ids_ref, wts_ref, h_ref, *rest = refs
    sh_ref, bits_ref, sc_ref, y_ref = rest if quant else (None, *rest)
    bm, bn, bkw = cfg.bm, cfg.bn2, cfg.bkw2
    t = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    common = dict(n_steps=kw_total // bkw, bn=bn, bkw=bkw, planes=planes, wpg=wpg, unpack=cfg.unpack,
                  compute=cfg.compute)
    vpu = cfg.compute in ("vpu", "vpu2d")

    def slot(s, acc_tot):
        e = ids_ref[t, s]
        wt = wts_ref[t, s]
        r = t * k + s
        if vpu:
            (acc,) = _vpu_loop(lambda k0, kk: h_ref[r, pl.ds(k0, kk)], bits_ref, sc_ref, e, (n0,), **common)
        else:
            rows = jnp.full((bm,), r, jnp.int32)
            load_sx = (lambda g: sh_ref[rows, pl.ds(g, 1)]) if quant else None
            (acc,) = _mma_loop(lambda k0, kk: h_ref[rows, pl.ds(k0, kk)], bits_ref, sc_ref, e, (n0,), bm=bm,
                               load_sx=load_sx, **common)
        return acc_tot + wt * acc

    acc = lax.fori_loop(0, k, slot, jnp.zeros((bn,) if vpu else (bm, bn), jnp.float32))
    y = acc if vpu else _row0(acc, bm)
    y_ref[t, pl.ds(n0, bn)] = y.astype(y_ref.dtype)


def _down_grp_kernel(*refs, cfg: KernelConfig, kw_total, wpg, planes, poison):
    refs = strip_poison(refs, poison)
    quant = cfg.compute == "mma_i8"
    blk_e_ref, blk_pos_ref, blk_n_ref, h_ref, *rest = refs
    sh_ref, bits_ref, sc_ref, ys_ref = rest if quant else (None, *rest)
    bm, bn, bkw = cfg.bm, cfg.bn2, cfg.bkw2
    b = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    e = blk_e_ref[b]
    pos0 = blk_pos_ref[b]
    nvalid = blk_n_ref[b]

    @pl.when(e >= 0)
    def _():
        def load_x(k0, kk):
            return h_ref[pl.ds(pos0, bm), pl.ds(k0, kk)]

        load_sx = (lambda g: sh_ref[pl.ds(pos0, bm), pl.ds(g, 1)]) if quant else None
        (acc,) = _mma_loop(load_x, bits_ref, sc_ref, e, (n0,), n_steps=kw_total // bkw, bm=bm, bn=bn, bkw=bkw,
                           planes=planes, wpg=wpg, unpack=cfg.unpack, compute=cfg.compute, load_sx=load_sx)
        rmask = lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < nvalid
        pltriton.store(ys_ref.at[pl.ds(pos0, bm), pl.ds(n0, bn)], acc.astype(ys_ref.dtype), mask=rmask)


# --------------------------------------------------------------------------------------------------
# launchers


def _resolve(cfg: KernelConfig, gate_up: PackedExperts, down: PackedExperts) -> KernelConfig:
    """Tiles fitted to the shapes: powers of two dividing them; with int8 activations, K steps inside one scale
    group."""
    inter, hidden = down.in_features, down.out_features
    bkw1 = _pow2_divisor(gate_up.bits.shape[2], cfg.bkw1)
    bkw2 = _pow2_divisor(down.bits.shape[2], cfg.bkw2)
    if cfg.compute == "mma_i8":
        bkw1 = _pow2_divisor(gate_up.words_per_group, bkw1)
        bkw2 = _pow2_divisor(down.words_per_group, bkw2)
    return dataclasses.replace(
        cfg, bn1=_pow2_divisor(inter, cfg.bn1), bn2=_pow2_divisor(hidden, cfg.bn2), bkw1=bkw1, bkw2=bkw2
    )


def _act(a) -> tuple:
    """An activation argument: an array, or (int8 array, its per-row group scales) for compute="mma_i8"."""
    return a if isinstance(a, tuple) else (a,)


def quantize_rows(x, group: int):
    """x [R, K] -> (int8 [R, K], float32 scales [R, ceil(K / group)]): symmetric per row and scale group."""
    r, k = x.shape
    ng = -(-k // group)
    xg = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, ng * group - k))).reshape(r, ng, group)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xg / scale[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(r, ng * group)[:, :k], scale


def gate_up_pairs(x, expert_ids, gate_up: PackedExperts, cfg: KernelConfig, *, interpret=False, poison=False):
    """h [T*k, I] bf16 for every (token, slot) pair in routing order."""
    t, k = expert_ids.shape
    inter = gate_up.out_features // 2
    kern = functools.partial(
        _gate_up_kernel, grouped=False, k=k, cfg=cfg, kw_total=gate_up.bits.shape[2],
        wpg=gate_up.words_per_group, planes=gate_up.planes, inter=inter, poison=poison,
    )
    out = jax.ShapeDtypeStruct((t * k, inter), jnp.bfloat16)
    args = (expert_ids.reshape(-1).astype(jnp.int32), *_act(x), gate_up.bits, gate_up.scales)
    return launch(kern, (t * k, inter // cfg.bn1), out, args, cfg, interpret, poison)


def down_pairs(h, expert_ids, expert_weights, down: PackedExperts, out_dtype, cfg: KernelConfig, *,
               interpret=False, poison=False):
    """y [T, H] = sum_k w_k * down_{e_k}(h_k), the weighted sum fused into the kernel."""
    t, k = expert_ids.shape
    hidden = down.out_features
    kern = functools.partial(
        _down_tok_kernel, k=k, cfg=cfg, kw_total=down.bits.shape[2], wpg=down.words_per_group,
        planes=down.planes, poison=poison,
    )
    out = jax.ShapeDtypeStruct((t, hidden), out_dtype)
    args = (expert_ids.astype(jnp.int32), expert_weights.astype(jnp.float32), *_act(h), down.bits, down.scales)
    return launch(kern, (t, hidden // cfg.bn2), out, args, cfg, interpret, poison)


def num_blocks(n_pairs: int, num_experts: int, bm: int) -> int:
    """Upper bound on the expert blocks of the grouped schedule: sum_e ceil(c_e / bm)."""
    return min(n_pairs, -(-n_pairs // bm) + min(num_experts, n_pairs))


def group_pairs(expert_ids, num_experts: int, bm: int):
    """Sort (token, slot) pairs by expert and cut them into blocks of <= bm rows of one expert.

    Returns (blk_expert [NB] (-1 = unused block), blk_pos [NB] (first sorted row), blk_n [NB] (rows),
    tok_sorted [P + bm] (token of each sorted row, padded), inv [P] (sorted row of each pair)).
    """
    t, k = expert_ids.shape
    p = t * k
    nb = num_blocks(p, num_experts, bm)
    flat = expert_ids.reshape(p).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    nblk = (counts + bm - 1) // bm
    cblk = jnp.cumsum(nblk)
    row_start = jnp.cumsum(counts) - counts
    b = jnp.arange(nb, dtype=jnp.int32)
    eb = jnp.sum((cblk[None, :] <= b[:, None]).astype(jnp.int32), axis=1)  # expert of block b
    valid = eb < num_experts
    ebc = jnp.minimum(eb, num_experts - 1)
    q = b - (cblk[ebc] - nblk[ebc])  # block index within its expert
    blk_pos = jnp.where(valid, row_start[ebc] + q * bm, 0).astype(jnp.int32)
    blk_n = jnp.where(valid, jnp.minimum(bm, counts[ebc] - q * bm), 0).astype(jnp.int32)
    blk_e = jnp.where(valid, eb, -1).astype(jnp.int32)
    tok_sorted = jnp.concatenate([order // k, jnp.zeros((bm,), jnp.int32)])
    inv = jnp.zeros((p,), jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
    return blk_e, blk_pos, blk_n, tok_sorted, inv


def gate_up_grouped(x, blocks, gate_up: PackedExperts, cfg: KernelConfig, *, interpret=False, poison=False):
    """h_sorted [P + bm, I] bf16: rows in expert-sorted pair order (rows >= P unwritten)."""
    blk_e, blk_pos, blk_n, tok_sorted, inv = blocks
    p = inv.shape[0]
    inter = gate_up.out_features // 2
    kern = functools.partial(
        _gate_up_kernel, grouped=True, k=1, cfg=cfg, kw_total=gate_up.bits.shape[2],
        wpg=gate_up.words_per_group, planes=gate_up.planes, inter=inter, poison=poison,
    )
    out = jax.ShapeDtypeStruct((p + cfg.bm, inter), jnp.bfloat16)
    args = (blk_e, blk_pos, blk_n, tok_sorted, *_act(x), gate_up.bits, gate_up.scales)
    return launch(kern, (blk_e.shape[0], inter // cfg.bn1), out, args, cfg, interpret, poison)


def down_grouped(h_sorted, blocks, down: PackedExperts, cfg: KernelConfig, *, interpret=False, poison=False):
    """y_sorted [P + bm, H] float32 (unweighted per-pair outputs, expert-sorted order)."""
    blk_e, blk_pos, blk_n, _, inv = blocks
    p = inv.shape[0]
    hidden = down.out_features
    kern = functools.partial(
        _down_grp_kernel, cfg=cfg, kw_total=down.bits.shape[2], wpg=down.words_per_group,
        planes=down.planes, poison=poison,
    )
    out = jax.ShapeDtypeStruct((p + cfg.bm, hidden), jnp.float32)
    args = (blk_e, blk_pos, blk_n, *_act(h_sorted), down.bits, down.scales)
    return launch(kern, (blk_e.shape[0], hidden // cfg.bn2), out, args, cfg, interpret, poison)


def moe_experts_1bit_pallas(
    x, expert_ids, expert_weights, gate_up: PackedExperts, down: PackedExperts, *,
    config: KernelConfig | None = None, interpret: bool = False, poison: bool = False,
):
    t, k = expert_ids.shape
    cfg = _resolve(config or default_config(t), gate_up, down)
    act_in = (lambda a, w: quantize_rows(a, w.group)) if cfg.compute == "mma_i8" else (lambda a, w: a)
    schedule = cfg.schedule
    if schedule == "auto":
        schedule = "pairs" if t <= cfg.pairs_max_tokens else "grouped"
    if schedule not in ("pairs", "grouped"):
        raise ValueError(f"unknown schedule {schedule!r}")
    if cfg.compute == "lut":
        return _moe_lut(x, expert_ids, expert_weights, gate_up, down, cfg, schedule, interpret, poison)
    if schedule == "pairs":
        h = act_in(gate_up_pairs(act_in(x, gate_up), expert_ids, gate_up, cfg, interpret=interpret, poison=poison),
                   down)
        if not cfg.split_pairs:
            return down_pairs(h, expert_ids, expert_weights, down, x.dtype, cfg, interpret=interpret, poison=poison)
        # h's rows are already one per pair: each pair is a "token" with one expert, its output a weighted partial.
        parts = down_pairs(h, expert_ids.reshape(t * k, 1), expert_weights.reshape(t * k, 1), down, jnp.float32,
                           cfg, interpret=interpret, poison=poison)
        return jnp.sum(parts.reshape(t, k, -1), axis=1).astype(x.dtype)
    # the vpu forms handle one row per block only
    if cfg.compute not in ("mma", "mma2d", "mma_tf32", "mma_i8", "mma_t"):
        cfg = dataclasses.replace(cfg, compute="mma2d" if cfg.compute == "vpu2d" else "mma")
    blocks = group_pairs(expert_ids, gate_up.num_experts, cfg.bm)
    h = gate_up_grouped(act_in(x, gate_up), blocks, gate_up, cfg, interpret=interpret, poison=poison)
    ys = down_grouped(act_in(h, down), blocks, down, cfg, interpret=interpret, poison=poison)
    return _weighted_sum(ys, blocks[4], expert_weights, x.dtype)


def _weighted_sum(ys, inv, expert_weights, dtype):
    """y [T, H] = sum_k w[t, k] * ys[inv[t * k + slot]]: per-pair rows (block order) back to tokens; ``inv=None``
    when the rows are already in routing order."""
    t, k = expert_weights.shape
    rows = ys[:t * k] if inv is None else ys[inv]
    y = rows.reshape(t, k, -1) * expert_weights.astype(jnp.float32)[..., None]
    return jnp.sum(y, axis=1).astype(dtype)


def _moe_lut(x, expert_ids, expert_weights, gate_up, down, cfg: KernelConfig, schedule, interpret, poison):
    """compute="lut": the onebit_lut kernels over one block per pair (pairs) or per expert (grouped)."""
    if schedule == "pairs":
        blocks = pair_blocks(expert_ids)
    else:
        blocks = group_pairs(expert_ids, gate_up.num_experts, cfg.bm)
    if cfg.lut_table not in ("float32", "bfloat16"):
        raise ValueError(f"lut_table must be 'float32' or 'bfloat16', got {cfg.lut_table!r}")
    dt = jnp.dtype(cfg.lut_table)
    h = gate_up_lut(nibble_tables(x, dt, cfg.lut_bits), blocks, gate_up, cfg, interpret=interpret, poison=poison)
    ys = down_lut(nibble_tables(h, dt, cfg.lut_bits), blocks, down, cfg, interpret=interpret, poison=poison)
    return _weighted_sum(ys, None if schedule == "pairs" else blocks[4], expert_weights, x.dtype)
