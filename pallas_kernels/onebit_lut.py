"""Lookup-table kernels (Triton lowering) for the routed experts on packed 1-bit weights, for few rows per expert.

The MMA kernels of ``onebit_pallas`` turn every weight into a bf16 dot operand (a shift, an and, an xor and a
conversion per weight, then a trip through shared memory), which measured ~3 T weights/s on an H200 -- far from the
~24 T weights/s that reading 1-bit weights at the memory bandwidth allows. Here the activations do the expansion
instead. For each activation row ``a [K]`` (x for gate_up, h for down) XLA builds the table of the 16 signed sums of
every 4 consecutive inputs::

    tab[r, g, v] = sum_{j<4} a[r, 4g + j] * (+1 if bit j of v else -1)        g < K/4, v < 16

A nibble of a packed word (bits 4i..4i+3 of word w hold inputs 4g..4g+3, g = 8w + i; LSB first, as in
docs/FORMATS.md) then contributes ``tab[r, g, nibble]``, one gather and one add per 4 weights; the word's 8
nibble sums are multiplied by its group's scale once. The lanes of a warp hold one word row for consecutive output
columns, so a warp's 32 gathers fall into one 64-byte table row (one L1 wavefront).

Every weight is read once per row that uses it (no MMA, no padding of a block's rows to 16), so this is the
schedule for decode: ~1-2 rows per distinct expert. Blocks come from ``group_pairs`` (one expert per block; a
block walks its rows in turn) or, for the pairs schedule, one block per (token, slot) pair. The tables cost
``4 * K`` floats per row, 16 per 4 inputs (40 KB per token for gate_up, 10 KB per pair for down at Flash-Next
shapes), read through L1/L2. ``KernelConfig(lut_bits=8)`` indexes by bytes instead (256 entries per 8 inputs): half
the gathers, but 16x the table bytes, and it measured 2-3x slower because the gathers then miss L1 (docs/PERF.md,
"What bounds the lookup-table kernel").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.activations import silu
from pallas_kernels.onebit_common import launch, strip_poison
from pallas_kernels.onebit_format import WORD_BITS, PackedExperts

NIBBLE_BITS = 4
# Index widths: 4 (nibbles: 16-entry tables, one gather per 4 weights) or 8 (bytes: 256-entry tables, 16x the table
# bytes, one gather per 8 weights -- half the shifts, masks, address sums and gathers).
LUT_BITS = (4, 8)


def nibble_tables(a: jax.Array, dtype=jnp.float32, bits: int = NIBBLE_BITS) -> jax.Array:
    """a [R, K] -> flat table [R * K/b * 2^b] for index width b = ``bits`` (4, or 8 for byte tables): entry
    (r, g, v) = sum_{j<b} a[r, b*g+j] * (+1 if bit j of v else -1)."""
    if bits not in LUT_BITS:
        raise ValueError(f"lut bits must be one of {LUT_BITS}, got {bits}")
    r, k = a.shape
    if k % bits:
        raise ValueError(f"in_features {k} is not a multiple of {bits}")
    ab = a.astype(jnp.float32).reshape(r, k // bits, bits)
    v = jnp.arange(1 << bits, dtype=jnp.int32)
    tab = None
    for j in range(bits):
        sign = (((v >> j) & 1) * 2 - 1).astype(jnp.float32)  # [2^b]
        term = ab[..., j, None] * sign
        tab = term if tab is None else tab + term
    return tab.astype(dtype).reshape(-1)


def pair_blocks(expert_ids: jax.Array):
    """Blocks of the pairs schedule in ``group_pairs``' format: one block per (token, slot) pair, in routing
    order (no padding rows: a block never spills past the last pair)."""
    t, k = expert_ids.shape
    p = t * k
    rows = jnp.arange(p, dtype=jnp.int32)
    return expert_ids.reshape(p).astype(jnp.int32), rows, jnp.ones((p,), jnp.int32), rows // k, rows


def _row_len(kw_total: int, bits: int) -> int:
    """Table entries per activation row: K/b index groups of 2^b entries (K = 32 * kw_total)."""
    return kw_total * (WORD_BITS // bits) * (1 << bits)


def _load(ref, idx, stream: bool):
    if not stream:
        return ref[idx]
    # Python ints become int32 scalars: interpret mode's discharge of a ref view needs shaped indices.
    idx = tuple(i if isinstance(i, pl.Slice) else jnp.asarray(i, jnp.int32) for i in idx)
    return pltriton.load(ref.at[idx], eviction_policy="evict_first")


def _lut_loop(tab_ref, base, bits_ref, sc_ref, e, n0s, *, n_steps, bn, bkw, planes, wpg, w_start=0, lut_bits=4,
              unroll=False, stream=False):
    """sum over words [w_start, w_start + n_steps * bkw) of a . W^T for one row (its table starting at ``base``)
    and len(n0s) column tiles of expert ``e``: a float32 [bkw, bn] partial sum per tile (the caller sums axis 0).
    ``unroll`` writes the K steps out in line (no loop), so the compiler can issue every step's word loads before
    the first gathers wait on them. ``stream`` loads the words with the evict-first cache hint, so that they do not
    push the tables out of L1."""
    word_row = lax.broadcasted_iota(jnp.int32, (bkw, 1), 0)
    per_word = WORD_BITS // lut_bits
    table_size = 1 << lut_bits

    def body(it, accs):
        w0 = w_start + it * bkw
        gidx = lax.div(w0 + lax.broadcasted_iota(jnp.int32, (bkw,), 0), jnp.int32(wpg))
        first = base + (w0 + word_row) * (per_word * table_size)  # [bkw, 1]: the word's first table row
        accs = list(accs)
        for c, n0 in enumerate(n0s):
            for p in range(planes):
                words = _load(bits_ref, (e, p, pl.ds(w0, bkw), pl.ds(n0, bn)), stream)
                sc = sc_ref[e, p, gidx, pl.ds(n0, bn)].astype(jnp.float32)
                s = None
                for i in range(per_word):
                    nib = ((words >> jnp.uint32(lut_bits * i)) & jnp.uint32(table_size - 1)).astype(jnp.int32)
                    v = tab_ref[first + (i * table_size) + nib].astype(jnp.float32)
                    s = v if s is None else s + v
                accs[c] = accs[c] + s * sc
        return tuple(accs)

    z = jnp.zeros((bkw, bn), jnp.float32)
    accs = tuple(z for _ in n0s)
    if not unroll:
        return lax.fori_loop(0, n_steps, body, accs)
    for it in range(n_steps):
        accs = body(it, accs)
    return accs


def _gate_up_kernel(*refs, bn, bkw, kw_total, wpg, planes, inter, ksplit, poison, lut_bits, unroll, stream):
    """One block of rows x one column tile of gate and up: silu(g) * u into h [rows, I]; or, with the K range
    split over grid axis 2 (``ksplit`` > 1), the raw partial g | u into [ksplit, rows, 2I] for XLA to finish."""
    blk_e_ref, blk_pos_ref, blk_n_ref, tok_ref, tab_ref, bits_ref, sc_ref, h_ref = strip_poison(refs, poison)
    b = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    e = blk_e_ref[b]
    pos0 = blk_pos_ref[b]
    row_len = _row_len(kw_total, lut_bits)
    kw_part = kw_total // ksplit
    s = pl.program_id(2) if ksplit > 1 else 0
    loop = functools.partial(_lut_loop, tab_ref, bits_ref=bits_ref, sc_ref=sc_ref, e=e, n0s=(n0, n0 + inter),
                             n_steps=kw_part // bkw, bn=bn, bkw=bkw, planes=planes, wpg=wpg, w_start=s * kw_part,
                             lut_bits=lut_bits, unroll=unroll, stream=stream)

    def row(r, carry):
        acc_g, acc_u = loop(tok_ref[pos0 + r] * row_len)
        g, u = jnp.sum(acc_g, axis=0), jnp.sum(acc_u, axis=0)
        if ksplit > 1:
            h_ref[s, pos0 + r, pl.ds(n0, bn)] = g
            h_ref[s, pos0 + r, pl.ds(n0 + inter, bn)] = u
        else:
            h_ref[pos0 + r, pl.ds(n0, bn)] = (silu(g) * u).astype(h_ref.dtype)
        return carry

    lax.fori_loop(0, blk_n_ref[b], row, jnp.int32(0))


def _down_kernel(*refs, bn, bkw, kw_total, wpg, planes, poison, lut_bits, unroll, stream):
    blk_e_ref, blk_pos_ref, blk_n_ref, tab_ref, bits_ref, sc_ref, ys_ref = strip_poison(refs, poison)
    b = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    e = blk_e_ref[b]
    pos0 = blk_pos_ref[b]
    row_len = _row_len(kw_total, lut_bits)

    def row(r, carry):
        (acc,) = _lut_loop(tab_ref, (pos0 + r) * row_len, bits_ref, sc_ref, e, (n0,), n_steps=kw_total // bkw,
                           bn=bn, bkw=bkw, planes=planes, wpg=wpg, lut_bits=lut_bits, unroll=unroll, stream=stream)
        ys_ref[pos0 + r, pl.ds(n0, bn)] = jnp.sum(acc, axis=0).astype(ys_ref.dtype)
        return carry

    lax.fori_loop(0, blk_n_ref[b], row, jnp.int32(0))


def gate_up_lut(x_tab, blocks, gate_up: PackedExperts, cfg, *, interpret=False, poison=False):
    """h [rows, I] float32 in block row order, one row per entry of the blocks' token list (padding rows
    unwritten). With ``cfg.lut_ksplit`` > 1 the K range is split over that many programs per tile (more programs
    for few rows) and XLA adds the partial sums before the activation."""
    blk_e, blk_pos, blk_n, tok, _ = blocks
    inter = gate_up.out_features // 2
    kw_total = gate_up.bits.shape[2]
    ksplit = _divisor_at_most(kw_total // cfg.bkw1, cfg.lut_ksplit)
    kern = functools.partial(_gate_up_kernel, bn=cfg.bn1, bkw=cfg.bkw1, kw_total=kw_total,
                             wpg=gate_up.words_per_group, planes=gate_up.planes, inter=inter, ksplit=ksplit,
                             poison=poison, lut_bits=cfg.lut_bits, unroll=cfg.lut_unroll,
                             stream=cfg.lut_stream)
    args = (blk_e, blk_pos, blk_n, tok, x_tab, gate_up.bits, gate_up.scales)
    grid = (blk_e.shape[0], inter // cfg.bn1)
    if ksplit == 1:
        return launch(kern, grid, jax.ShapeDtypeStruct((tok.shape[0], inter), jnp.float32), args, cfg, interpret,
                    poison)
    parts = launch(kern, (*grid, ksplit), jax.ShapeDtypeStruct((ksplit, tok.shape[0], 2 * inter), jnp.float32), args,
                 cfg, interpret, poison)
    gu = jnp.sum(parts, axis=0)
    return silu(gu[:, :inter]) * gu[:, inter:]


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


def down_lut(h_tab, blocks, down: PackedExperts, cfg, *, interpret=False, poison=False):
    """ys [rows, H] float32: each row's unweighted down projection, block row order (rows as ``gate_up_lut``)."""
    blk_e, blk_pos, blk_n, tok, _ = blocks
    hidden = down.out_features
    kern = functools.partial(_down_kernel, bn=cfg.bn2, bkw=cfg.bkw2, kw_total=down.bits.shape[2],
                             wpg=down.words_per_group, planes=down.planes, poison=poison, lut_bits=cfg.lut_bits,
                             unroll=cfg.lut_unroll, stream=cfg.lut_stream)
    out = jax.ShapeDtypeStruct((tok.shape[0], hidden), jnp.float32)
    args = (blk_e, blk_pos, blk_n, h_tab, down.bits, down.scales)
    return launch(kern, (blk_e.shape[0], hidden // cfg.bn2), out, args, cfg, interpret, poison)
