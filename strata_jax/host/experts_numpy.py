"""Routed experts on the host, in numpy, straight from the packed 1-bit bytes (docs/FORMATS.md, "Packed
expert format"): no float32 copy of any weight matrix is ever made. The reference of the compiled host kernel
(`strata_jax.host.experts_xla`, the tier's default); weight bits may be in either layout of the format (packed words
or byte-major, `pallas_kernels.onebit_format.byte_rows`).

The formulation is a lookup table over bytes of packed signs. A projection with P sign planes is::

    y[t, n] = sum_p sum_g scale[p, g, n] * (x[t, g] . sign[p, g, n])        sign = 2*bit - 1
    x . sign = 2 * (sum of x over the set bits) - (sum of x)

and the sum of x over the set bits of one byte of weights (8 consecutive inputs) is one of 256 numbers that
depend on x only. So, per token, a table ``lut[t, c, v]`` (c = byte of the input axis, v = 0..255) is built
once with one small matmul (``x[t, c, 0:8] @ BITS[v]``, 256 x 8), and every output's masked sum is a gather
of ``K/8`` table entries indexed by the weight bytes, summed per scale group. The uint32 words are read as
their 4 little-endian bytes in place (``bits.view(uint8)``): byte ``b`` of word ``w`` holds inputs
``32w + 8b .. 32w + 8b + 7``, bit j = input ``32w + 8b + j``, which is exactly the table's bit order, so the
weights are never transposed or unpacked. Per (token, expert, plane) that is ``K/8 * N`` float gathers
(Flash-Next: 410k for gate_up, 205k for down) against ``K * N`` multiply-adds of a dense float matrix, and
it reads 1 bit per weight instead of 32.

The tables actually gathered hold ``x . sign`` per byte (`_sign_tables`; from byte sums: ``2 * masked sum - byte sum``), so
a projection is ``y[t, n] = sum_g scale[g, n] * sum_{c in g} table[c, byte(c, n), t]`` and needs no sums of x. Per
projection (`_project_signed`) that is three large numpy calls: a strided copy of the weight bytes into the low
byte of a per-thread intp index array whose other bytes hold each byte row's table offset (preset once, so no
index arithmetic), one ``np.take`` (mode "wrap": no bounds pass, no buffered copy), and one reduction over each
group's bytes; all planes at once. Up to 4 tokens are gathered per take as one 8- or 16-byte item (their
entries side by side). Fewer, larger calls matter more than cache blocking here: every numpy call is a GIL
hand-off between the pool's workers. The gate_up table depends on the token only, so it is shared by all of a
token's host experts; the down table is built per (token, expert) from the activation. No BLAS call on this
path exceeds OpenBLAS's threading threshold: its own threads would spin on the pool's cores.

An expert that receives many tokens at once (prefill) instead goes through `project_blocked`, which unpacks one
scale group's bits at a time to a small float32 block for BLAS. Experts are independent tasks: `host_experts`
runs them on a thread pool (numpy drops the GIL in take/sum/matmul).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable

import numpy as np

from pallas_kernels.activations import silu
from pallas_kernels.onebit_format import WORD_BITS, PackedExperts, byte_rows, check_pair, unpack_bits

# From this many tokens on one expert, `project_blocked` (BLAS on one unpacked scale group at a time) beats the
# byte tables (measured crossover ~12 tokens at Flash-Next shapes, numpy 2.4, 2026-11-29: the tables gather up to 4
# tokens per item, ~0.55 ms per token per expert, against ~4.3 ms + 0.3 ms per token blocked).
BLOCKED_MIN_TOKENS = 12
# BITS[v, j] = bit j of v (the format's bit order): the 0/1 masks of the 256 possible bytes; BYTE_SIGNS the same as
# -1/+1 (shared with `strata_jax.host.experts_xla`).
_BITS = np.ascontiguousarray(unpack_bits(np.arange(256, dtype=np.uint8)[None, :]).T, np.float32)
BYTE_SIGNS = 2.0 * _BITS - 1.0
# A gathered table item holds the entries of 1, 2 or 4 tokens side by side (3 is padded to 4); the take copies
# items bit for bit and never computes on them, so any dtype of that size does.
_ITEM_DTYPES = {1: np.dtype(np.float32), 2: np.dtype(np.float64), 4: np.dtype(np.complex128)}
_MAX_ITEM_TOKENS = 4
# Bytes of one column block's index array (intp per weight byte, per thread, reused): the projection is split in
# column blocks only beyond this. Fewer, larger numpy calls win here: every call is a GIL hand-off between the
# pool's workers, and at these sizes the streaming ops are not cache bound (measured 2026-11-29).
_BLOCK_INDEX_BYTES = 1 << 23
_LOW_BYTE = 0 if sys.byteorder == "little" else np.dtype(np.intp).itemsize - 1
_THREAD = threading.local()


def byte_tables(x: np.ndarray) -> np.ndarray:
    """x [T, K] float32 -> lut [T, K/8 * 256] float32: lut[t, c*256 + v] = sum of x[t, 8c + j] over the set
    bits j of v."""
    t, k = x.shape
    return (x.reshape(t, k // 8, 8) @ _BITS.T).reshape(t, (k // 8) * 256)


def _padded_tokens(t: int) -> int:
    return 1 if t == 1 else 2 if t == 2 else 4


# Rows of one sign-table matmul ([rows, 8] @ [8, 256]): small enough that OpenBLAS runs it on the calling thread.
# A product over its threading threshold (m*n*k > 4 * 65536) wakes OpenBLAS's own threads, which then spin for a
# while and take the cores from the pool's workers (measured: 10 host pairs on 2 workers 6.5 ms instead of 9.5 ms).
_TABLE_ROWS = 64


def _sign_products(x8: np.ndarray) -> np.ndarray:
    """x8 [R, 8] float32 -> [R, 256]: row r, byte value v -> x8[r] . (2 * bits(v) - 1); batched in `_TABLE_ROWS`."""
    r = x8.shape[0]
    if r <= _TABLE_ROWS:
        return x8 @ BYTE_SIGNS.T
    pad = -r % _TABLE_ROWS
    if pad:
        x8 = np.concatenate([x8, np.zeros((pad, 8), x8.dtype)])
    return (x8.reshape(-1, _TABLE_ROWS, 8) @ BYTE_SIGNS.T).reshape(-1, 256)[:r]


def _sign_tables(x: np.ndarray) -> np.ndarray:
    """x [T, K] -> per-token sign tables [T, K/8 * 256]: entry (t, c*256 + v) = x[t, 8c : 8c + 8] . (2 * bits(v) - 1),
    the dot product with the signs of byte v."""
    t, k = x.shape
    return _sign_products(np.ascontiguousarray(x, np.float32).reshape(t * (k // 8), 8)).reshape(t, (k // 8) * 256)


def _signs_from_lut(lut: np.ndarray) -> np.ndarray:
    """`byte_tables` output [T, L] -> `_sign_tables` [T, L] (byte value 255 holds the byte's sum of x)."""
    t, length = lut.shape
    lut3 = lut.reshape(t, length // 256, 256)
    return (2.0 * lut3 - lut3[:, :, 255:]).reshape(t, length)


def _item_table(tables: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The sign tables [*, L] of t <= 4 rows -> [L] items of t' = 1, 2 or 4 tokens side by side (`_ITEM_DTYPES`);
    one row's table is used in place."""
    t, length = rows.size, tables.shape[1]
    tp = _padded_tokens(t)
    if tp == 1:
        return tables[rows[0]]
    wide = np.zeros((length, tp), np.float32)
    wide[:, :t] = tables[rows].T
    return wide.view(_ITEM_DTYPES[tp]).reshape(length)


def _by_items(tables: np.ndarray, rows: np.ndarray, project_items) -> np.ndarray:
    """project_items(item table, tokens) over `rows` of the sign tables [*, L] in chunks of <= 4 -> [rows, N]."""
    parts = [project_items(_item_table(tables, rows[i : i + _MAX_ITEM_TOKENS]), min(_MAX_ITEM_TOKENS, rows.size - i))
             for i in range(0, rows.size, _MAX_ITEM_TOKENS)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _thread_buffer(name: str, key: tuple, make) -> np.ndarray:
    """A per-thread reusable buffer (no allocation churn; workers never share one)."""
    cache = _THREAD.__dict__.setdefault(name, {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _index_buffer(planes: int, kw: int, nb: int) -> np.ndarray:
    """This thread's intp [P, kw, 4, nb] index array of a column block, entry (p, w, b, n) preset to the table
    offset (4w + b) * 256 of byte b of word w. The offsets are multiples of 256, so writing a weight byte into an
    entry's low byte makes it offset + byte, and nothing else ever changes."""

    def make():
        rows = (np.arange(kw)[:, None] * 4 + np.arange(4)[None, :]) * 256
        return np.ascontiguousarray(np.broadcast_to(rows[None, :, :, None], (planes, kw, 4, nb)), np.intp)

    return _thread_buffer("index", (planes, kw, nb), make)


def _project_signed(table: np.ndarray, t: int, bits: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """`project` from an item table of t <= 4 tokens (`_item_table`) -> y float32 [t, N].

    y[t, n] = sum_{p, g} scale[p, g, n] * sum over the bytes c of group g of table[c*256 + byte(p, c, n), t]:
    per column block, one strided byte copy into the preset index array, one take and one reduction over each
    group's bytes, all planes at once."""
    b4 = byte_rows(bits)
    planes, kw, _, n = b4.shape
    tp = table.dtype.itemsize // 4
    rows = kw * 4  # bytes of weights along the input axis
    bpg = group // 8
    groups = -(-rows // bpg)
    full = rows // bpg
    blocks = -(-(planes * rows * n * 8) // _BLOCK_INDEX_BYTES)
    nb = -(-n // blocks)
    sums = np.empty((planes, groups, n, tp), np.float32)
    for n0 in range(0, n, nb):
        m = min(nb, n - n0)
        idx = _index_buffer(planes, kw, m)
        np.copyto(idx.view(np.uint8)[..., _LOW_BYTE :: idx.itemsize], b4[..., n0 : n0 + m])
        masked = _thread_buffer("masked", (planes, rows, m, table.dtype), lambda: np.empty((planes, rows, m), table.dtype))
        np.take(table, idx.reshape(planes, rows, m), out=masked, mode="wrap")  # in range by construction
        mf = masked.view(np.float32).reshape(planes, rows, m, tp)
        blk = sums[:, :, n0 : n0 + m]
        np.sum(mf[:, : full * bpg].reshape(planes, full, bpg, m, tp), axis=2, out=blk[:, :full])
        if full < groups:  # a short last group
            np.sum(mf[:, full * bpg :], axis=1, out=blk[:, full])
    sc = scales.astype(np.float32).reshape(planes * groups, n)
    return np.einsum("gnt,gn->tn", sums.reshape(planes * groups, n, tp)[:, :, :t], sc)


def project(lut: np.ndarray, xsum: np.ndarray, bits: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """One expert's projection of T tokens from their byte tables.

    lut [T, K/8*256] (`byte_tables`), xsum [T, groups] (sum of x per scale group), bits uint32 [P, K/32, N]
    (or byte-major), scales [P, groups, N] (any float dtype) -> y float32 [T, N]. (The sums of x are read off the
    tables, where byte value 255 holds them, so xsum is implied and not used.)"""
    del xsum
    return _by_items(_signs_from_lut(lut), np.arange(lut.shape[0]),
                     lambda table, t: _project_signed(table, t, bits, scales, group))


def project_blocked(x: np.ndarray, xsum: np.ndarray, bits: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """`project` for many tokens of one expert (prefill): one scale group at a time, the 0/1 bits of the group are
    unpacked to a float32 block [group, N] (never the whole matrix) and multiplied by BLAS, so the cost hardly grows
    with the tokens, where the table gathers grow linearly (crossover ~3 tokens at Flash-Next shapes).

    x [T, K] float32, xsum [T, groups], bits uint32 [P, K/32, N], scales [P, groups, N] -> y float32 [T, N]."""
    b4 = byte_rows(bits)
    planes, kw, _, n = b4.shape
    wpg = group // WORD_BITS
    y = np.zeros((x.shape[0], n), np.float32)
    for p in range(planes):
        for g, w0 in enumerate(range(0, kw, wpg)):
            w1 = min(kw, w0 + wpg)
            block = unpack_bits(b4[p, w0:w1].reshape((w1 - w0) * 4, n)).astype(np.float32)  # [group, n]
            masked = x[:, w0 * WORD_BITS : w1 * WORD_BITS] @ block
            y += scales[p, g].astype(np.float32) * (2.0 * masked - xsum[:, g : g + 1])
    return y


def group_sums(x: np.ndarray, group: int) -> np.ndarray:
    """x [T, K] -> [T, ceil(K / group)] sums of x per scale group."""
    return np.add.reduceat(x, np.arange(0, x.shape[1], group), axis=1)


@dataclasses.dataclass(frozen=True)
class NumpyStack:
    """One MoE layer's experts for the numpy kernel: its gate_up and down stacks as numpy arrays (possibly memory
    maps; bits in either layout). Not a second format: two `PackedExperts` of the one format, paired with the numpy
    kernel's compute."""

    gate_up: PackedExperts  # [E, 2I, H]: gate = first I outputs
    down: PackedExperts  # [E, H, I]

    def __post_init__(self):
        check_pair(self.gate_up, self.down)

    @property
    def num_experts(self) -> int:
        return self.gate_up.num_experts

    @property
    def hidden(self) -> int:
        return self.down.out_features

    def expert_output(self, e: int, x: np.ndarray, lut: np.ndarray, xsum: np.ndarray) -> np.ndarray:
        """down_e(silu(gate_e x) * up_e x) for rows x [T, H] (with their gate_up tables) -> [T, H] float32.
        Few rows use the byte tables, many (prefill) the blocked BLAS path."""
        if x.shape[0] < BLOCKED_MIN_TOKENS:
            return _by_items(_signs_from_lut(lut), np.arange(x.shape[0]), functools.partial(self._table_output, e))
        return self._blocked_output(e, x, xsum)

    def _table_output(self, e: int, table: np.ndarray, t: int) -> np.ndarray:
        """The byte-table path for t <= 4 rows from their gate_up item table (`_item_table`)."""
        gu_w, dn_w = self.gate_up, self.down
        inter = dn_w.in_features
        gu = _project_signed(table, t, gu_w.bits[e], gu_w.scales[e], gu_w.group)
        act = silu(gu[:, :inter]) * gu[:, inter:]
        return _project_signed(_item_table(_sign_tables(act), np.arange(t)), t, dn_w.bits[e], dn_w.scales[e],
                               dn_w.group)

    def _blocked_output(self, e: int, x: np.ndarray, xsum: np.ndarray) -> np.ndarray:
        gu_w, dn_w = self.gate_up, self.down
        inter = dn_w.in_features
        gu = project_blocked(x, xsum, gu_w.bits[e], gu_w.scales[e], gu_w.group)
        act = silu(gu[:, :inter]) * gu[:, inter:]
        return project_blocked(act, group_sums(act, dn_w.group), dn_w.bits[e], dn_w.scales[e], dn_w.group)


Task = tuple[int, np.ndarray, np.ndarray]  # (expert, its token rows [t], their weights float32 [t, 1])


def expert_tasks(ids: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> list[Task]:
    """The masked pairs of ids/weights/mask [T, k] grouped by expert: [(expert, its token rows [t], weights float32
    [t, 1])], experts ascending, rows ascending within an expert."""
    t_idx, j_idx = np.nonzero(mask)
    experts = ids[t_idx, j_idx]
    order = np.argsort(experts, kind="stable")
    t_idx, j_idx, experts = t_idx[order], j_idx[order], experts[order]
    bounds = np.flatnonzero(np.diff(experts)) + 1
    return [(int(ids[ts[0], js[0]]), ts, weights[ts, js].astype(np.float32)[:, None])
            for ts, js in zip(np.split(t_idx, bounds), np.split(j_idx, bounds)) if ts.size]


def host_experts(
    stack: NumpyStack,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    mask: np.ndarray,
    pool: concurrent.futures.Executor | None = None,
) -> np.ndarray:
    """sum over the pairs (t, j) with mask[t, j] of weights[t, j] * expert_{ids[t, j]}(x[t]).

    x [T, H] float32, ids [T, k] int, weights [T, k], mask [T, k] bool -> [T, H] float32 (rows without a
    masked pair are 0). One task per distinct expert, run on `pool` when given. The gate_up sign tables are built
    once per token and shared by its experts."""
    out = np.zeros((x.shape[0], stack.hidden), np.float32)
    tasks = expert_tasks(ids, weights, mask)
    if not tasks:
        return out
    rows_any = np.flatnonzero(mask.any(axis=1))
    xr = np.ascontiguousarray(x[rows_any], np.float32)
    tables = _sign_tables(xr)
    local = np.full(x.shape[0], -1, np.intp)
    local[rows_any] = np.arange(xr.shape[0])

    def run(task):
        e, ts, w = task
        rows = local[ts]
        if rows.size >= BLOCKED_MIN_TOKENS:
            xe = xr[rows]
            return ts, w * stack._blocked_output(e, xe, group_sums(xe, stack.gate_up.group))
        y = _by_items(tables, rows, functools.partial(stack._table_output, e))
        y *= w
        return ts, y

    return run_tasks(run, tasks, out, pool)


def run_tasks(run: Callable[[Task], tuple[np.ndarray, np.ndarray]], tasks: list[Task], out: np.ndarray,
              pool: concurrent.futures.Executor | None) -> np.ndarray:
    """Runs `run` on every task of `expert_tasks` (on `pool` when given and there are several) and adds each result,
    (token rows, their outputs), into `out`."""
    results = pool.map(run, tasks) if pool is not None and len(tasks) > 1 else map(run, tasks)
    for ts, y in results:
        out[ts] += y  # a token routes to an expert at most once
    return out
