"""Routed experts on the host compiled by numba: one parallel call per MoE layer, on the packed byte-major bits
(docs/FORMATS.md, "Host tier"), never a float32 copy of a weight matrix.

The formulation is the numpy reference's (`strata_jax.host.experts_numpy`): for one byte row ``r`` of the input axis
(inputs ``8r .. 8r + 7``, bit j = input ``8r + j``) a row's sign table holds, for each of the 256 byte values ``v``,
``sum_j a[8r + j] * (2 * bit_j(v) - 1)``; a projection is then ``y[n] = sum_p sum_g scale[p, g, n] * sum_{r in g}
table[r, byte(p, r, n)]``, one table load and one add per 8 weights. Tables are built by doubling (entry ``v + 2^j``
= entry ``v`` + ``2 a[8r + j]``: one add per entry); gate_up's are per token and shared by all of its experts, down's
per (token, expert) pair.

One call (`host_experts_numba`) runs a whole layer's host pairs in six parallel loops (numba ``prange``, every thread
of the call busy, no GIL): gate_up tables, gate_up projections, SiLU(gate) * up, the down tables, down projections,
and the weighted sum into the output. A projection's work items are (expert, block of output columns), handed out one
at a time: an item reads its expert's bytes for those columns once for all of the expert's tokens, so threads never
share an output (the result does not depend on the thread count) and each expert's bytes are read once per call.
Within an item, eight columns at a time are summed in registers over one scale group's byte rows, whose table rows
and bytes stay in L1. An expert with many tokens
(prefill, ``DENSE_MIN_TOKENS``) instead unpacks one scale group x block of signs to +-1 floats in a small buffer and
multiplies, whose cost hardly grows with the tokens. bf16 scales are read in place as uint16 (float32 = bits << 16).

numba is optional: it is imported on first use (`numba_available`); without it the tier falls back to the XLA:CPU
kernel (`strata_jax.host.tier`). Compiled code is cached on disk (numba ``cache=True``, ``__pycache__``), so only the
first call in a fresh checkout compiles (~30 s of CPU for the parallel build, ~8 s for the one-thread build).

Measured (docs/PERF.md, "The numba host kernel"; 2 shared CPUs, 2026-12-02): 0.56-0.80 ms of CPU per (token, expert)
pair at Flash-Next shapes against XLA:CPU's 0.88-1.23, bound by the table loads (~0.44 ns each), not by memory."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import types

import numpy as np

from pallas_kernels.onebit_format import PackedExperts, check_pair
from strata_jax.host.experts_numpy import expert_tasks

# From this many tokens on one expert, unpack-and-multiply beats the tables (the table path costs one gather per 8
# weights per token, the dense one ~1/8 of an FMA per weight per token plus the unpacking).
DENSE_MIN_TOKENS = 16
# Output columns per work item: a multiple of 32 (whole cache lines of bytes), at most this many; fewer when the
# layer's pairs would otherwise leave threads without work.
_MAX_BLOCK = 256
_MIN_BLOCK = 32
_ITEMS_PER_THREAD = 4
# numba's workqueue threading layer (the fallback where libgomp is missing) aborts on concurrent calls from two
# threads, and one call already uses every thread; the lock also makes the first call's compilation happen once.
_CALL_LOCK = threading.Lock()
# The threading layers tried in order when NUMBA_THREADING_LAYER is not set (numba wants all three named; its own
# order starts with TBB, which was never measured here, and the workqueue always loads, so TBB is never reached).
THREADING_LAYERS = ("omp", "workqueue", "tbb")


@functools.cache
def _numba():
    """The numba module, or None when it is not installed or does not import (e.g. a numpy it does not support).

    Prefers numba's OpenMP threading layer, then its own "workqueue" one, unless NUMBA_THREADING_LAYER says
    otherwise. Measured with `bench --mode host --preset flash-next-125b --host-kernel numba` (docs/PERF.md, "The numba
    host kernel"): on the H200's 16-core host (15 threads) a layer of 3 / 40 pairs took 0.47 / 4.09 ms with OpenMP
    against 1.86 / 7.78 with the workqueue (2026-12-04 17:20); on 2 cores 0.58 / 6.93 against 2.49 / 8.52 quiet, and
    0.62 / 18.01 against 1.26 / 14.88 beside two busy loops (2026-12-04 17:30): the workqueue wakes its threads for
    each of the six parallel loops, OpenMP's threads spin briefly first (libgomp's default wait policy)."""
    try:
        import numba
    except Exception:  # ImportError, or numba's own check of the numpy version
        return None
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = list(THREADING_LAYERS)
        numba.config.THREADING_LAYER = "default"
    return numba


def threading_layer() -> str | None:
    """The threading layer numba's parallel calls run on in this process (after the first one), else None."""
    nb = _numba()
    if nb is None:
        return None
    try:
        return nb.threading_layer()
    except ValueError:  # no parallel call yet
        return None


def numba_available() -> bool:
    """Whether the numba kernel can run in this process (imports numba on the first call)."""
    return _numba() is not None


def max_threads() -> int:
    """Threads numba may run a parallel call on (NUMBA_NUM_THREADS); 0 without numba."""
    nb = _numba()
    return nb.config.NUMBA_NUM_THREADS if nb is not None else 0


def _column_block(n: int, tasks: int, threads: int) -> int:
    """Output columns per work item: enough items for `_ITEMS_PER_THREAD` per thread, within [32, 256] columns."""
    want = n * tasks // max(1, threads * _ITEMS_PER_THREAD)
    return int(min(_MAX_BLOCK, max(_MIN_BLOCK, want // _MIN_BLOCK * _MIN_BLOCK)))


# The kernel's functions below are plain Python until `_kernels` compiles them: numba is imported on first use only,
# and they live at module level (not in a closure) because numba's disk cache keys closures by their cells, which
# differ in every process. `prange` is `range` until then.
prange = range


def _table_row(a, t):
    """t[v] = sum_j a[j] * (2 bit_j(v) - 1) for the 256 byte values v of a's 8 inputs, by doubling."""
    total = np.float32(0.0)
    for j in range(8):
        total += a[j]
    t[0] = -total
    width = 1
    for j in range(8):
        twice = np.float32(2.0) * a[j]
        for v in range(width):
            t[width + v] = t[v] + twice
        width *= 2


def _project_item(src, src_rows, tables, table_rows, bits, scales, group, n0, n1, dense, dst, dst_rows):
    """One work item: dst[dst_rows[i], n0:n1] = rows src_rows[i] of src (their sign tables: rows table_rows[i]
    of tables) through one expert's planes, bits uint8 [P, K/8, N], scales bf16 bits uint16 [P, groups, N]."""
    planes, nbytes = bits.shape[0], bits.shape[1]
    bpg = group // 8
    ngroups = scales.shape[1]
    t, nb_ = src_rows.shape[0], n1 - n0
    acc = np.zeros((t, nb_), np.float32)
    part = np.empty((t, nb_), np.float32)
    sbits = np.empty(nb_, np.uint32)
    sf = sbits.view(np.float32)
    blk = np.empty((group, nb_), np.float32) if dense else np.empty((1, 1), np.float32)
    for p in range(planes):
        for g in range(ngroups):
            r0 = g * bpg
            r1 = min(nbytes, r0 + bpg)
            part[:] = 0.0
            if dense:
                for r in range(r0, r1):
                    brow = bits[p, r, n0:n1]
                    for j in range(8):
                        out = blk[(r - r0) * 8 + j]
                        for n in range(nb_):
                            out[n] = np.float32(((brow[n] >> j) & 1) * 2) - np.float32(1.0)
                k0, kn = r0 * 8, (r1 - r0) * 8
                for i in range(t):
                    xi = src[src_rows[i], k0: k0 + kn]
                    pi = part[i]
                    for k in range(kn):
                        xv = xi[k]
                        bk = blk[k]
                        for n in range(nb_):
                            pi[n] += xv * bk[n]
            else:
                # Eight columns at a time, summed over the group's byte rows in eight registers: the group's table
                # rows (bpg KB) and bytes stay in L1, nothing is stored until the group ends, and the eight
                # independent sums hide the add latency (numba keeps the order of float adds within one sum).
                for i in range(t):
                    tab = tables[table_rows[i]]
                    pi = part[i]
                    n = 0
                    while n + 8 <= nb_:
                        c = n0 + n
                        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
                        for r in range(r0, r1):
                            base = 256 * r
                            s0 += tab[base + bits[p, r, c]]
                            s1 += tab[base + bits[p, r, c + 1]]
                            s2 += tab[base + bits[p, r, c + 2]]
                            s3 += tab[base + bits[p, r, c + 3]]
                            s4 += tab[base + bits[p, r, c + 4]]
                            s5 += tab[base + bits[p, r, c + 5]]
                            s6 += tab[base + bits[p, r, c + 6]]
                            s7 += tab[base + bits[p, r, c + 7]]
                        pi[n], pi[n + 1], pi[n + 2], pi[n + 3] = s0, s1, s2, s3
                        pi[n + 4], pi[n + 5], pi[n + 6], pi[n + 7] = s4, s5, s6, s7
                        n += 8
                    for m in range(n, nb_):  # a block narrower than 8 at the end of an odd width
                        s0 = np.float32(0.0)
                        for r in range(r0, r1):
                            s0 += tab[256 * r + bits[p, r, n0 + m]]
                        pi[m] = s0
            srow = scales[p, g, n0:n1]
            for n in range(nb_):
                sbits[n] = np.uint32(srow[n]) << 16
            for i in range(t):
                ai, pi = acc[i], part[i]
                for n in range(nb_):
                    ai[n] += sf[n] * pi[n]
    for i in range(t):
        dst[dst_rows[i], n0:n1] = acc[i]


def _layer(x, pair_row, pair_w, task_start, task_expert, gu_bits, gu_scales, dn_bits, dn_scales, group,
          block_gu, block_dn, dense_min, out):
    """One layer's host pairs: out[pair_row[q]] += pair_w[q] * expert(x[pair_row[q]]) for every pair q (pairs
    grouped by expert: task i = pairs task_start[i] .. task_start[i+1] of expert task_expert[i])."""
    npairs, ntasks = pair_row.shape[0], task_expert.shape[0]
    inter = dn_bits.shape[2] * 8
    hidden = out.shape[1]
    pair_dense = np.zeros(npairs, np.bool_)
    for i in range(ntasks):
        if task_start[i + 1] - task_start[i] >= dense_min:
            pair_dense[task_start[i]: task_start[i + 1]] = True
    # gate_up: one sign table per token row that has a pair on the table path (slot_of_row: its table, -1 none;
    # pair_gu_slot: each pair's), so a prompt chunk whose experts all take the dense path builds none.
    slot_of_row = np.full(x.shape[0], -1, np.int64)
    table_x_rows = np.empty(npairs, np.int64)
    gu_slots = 0
    pair_gu_slot = np.zeros(npairs, np.int64)
    for q in range(npairs):
        if not pair_dense[q]:
            if slot_of_row[pair_row[q]] < 0:
                slot_of_row[pair_row[q]] = gu_slots
                table_x_rows[gu_slots] = pair_row[q]
                gu_slots += 1
            pair_gu_slot[q] = slot_of_row[pair_row[q]]
    gu_rows = gu_bits.shape[2]
    gu_tables = np.empty((gu_slots, gu_rows * 256), np.float32)
    for flat in prange(gu_slots * gu_rows):
        i, r = flat // gu_rows, flat % gu_rows
        _table_row(x[table_x_rows[i], 8 * r: 8 * r + 8], gu_tables[i, 256 * r: 256 * r + 256])
    gu = np.empty((npairs, 2 * inter), np.float32)
    # Work items (task, column block), handed out one at a time (the caller sets numba's chunk size to 1):
    # tasks differ in tokens.
    nblocks = (2 * inter + block_gu - 1) // block_gu
    for item in prange(ntasks * nblocks):
        task, b = item // nblocks, item % nblocks
        p0, p1 = task_start[task], task_start[task + 1]
        e = task_expert[task]
        _project_item(x, pair_row[p0:p1], gu_tables, pair_gu_slot[p0:p1], gu_bits[e], gu_scales[e], group,
                     b * block_gu, min(2 * inter, (b + 1) * block_gu), p1 - p0 >= dense_min, gu, np.arange(p0, p1))
    # SiLU(gate) * up, then down's tables per pair.
    act = np.empty((npairs, inter), np.float32)
    for q in prange(npairs):
        for c in range(inter):
            gate = gu[q, c]
            act[q, c] = gate / (np.float32(1.0) + np.exp(-gate)) * gu[q, inter + c]
    pairs = np.arange(npairs)
    pair_dn_slot = np.zeros(npairs, np.int64)
    table_pairs = np.empty(npairs, np.int64)
    dn_slots = 0
    for q in range(npairs):
        if not pair_dense[q]:
            pair_dn_slot[q] = dn_slots
            table_pairs[dn_slots] = q
            dn_slots += 1
    dn_rows = dn_bits.shape[2]
    dn_tables = np.empty((dn_slots, dn_rows * 256), np.float32)
    for flat in prange(dn_slots * dn_rows):
        i, r = flat // dn_rows, flat % dn_rows
        _table_row(act[table_pairs[i], 8 * r: 8 * r + 8], dn_tables[i, 256 * r: 256 * r + 256])
    y = np.empty((npairs, hidden), np.float32)
    nblocks = (hidden + block_dn - 1) // block_dn
    for item in prange(ntasks * nblocks):
        task, b = item // nblocks, item % nblocks
        p0, p1 = task_start[task], task_start[task + 1]
        e = task_expert[task]
        _project_item(act, pairs[p0:p1], dn_tables, pair_dn_slot[p0:p1], dn_bits[e], dn_scales[e], group,
                     b * block_dn, min(hidden, (b + 1) * block_dn), p1 - p0 >= dense_min, y, pairs[p0:p1])
    # Weighted sum per token row, over blocks of columns (a row may have several pairs: no two threads share
    # a column).
    cols = 64
    for c in prange((hidden + cols - 1) // cols):
        c0, c1 = c * cols, min(hidden, (c + 1) * cols)
        for q in range(npairs):
            w = pair_w[q]
            r = pair_row[q]
            for n in range(c0, c1):
                out[r, n] += w * y[q, n]


@functools.cache
def _kernels():
    """The layer kernel, (parallel, serial), each compiled on its first call (or loaded from numba's disk cache).
    Needs numba (`numba_available`). Rebinds the module's kernel functions to their compiled versions, which is how
    numba resolves the calls between them.

    The serial one runs on the calling thread: with one thread, each of the parallel kernel's five loops is handed
    to a numba worker and back, and on loaded cores every hand-off waits for the scheduler (one pair: 7.9 ms of wall
    for 3.5 ms of CPU, 2 shared CPUs, 2026-12-02). It is a copy of `_layer` under another name because numba's disk
    cache files a function's compiled versions by name, whatever the parallel flag."""
    nb = _numba()
    if nb is None:
        raise RuntimeError("the numba host kernel needs numba (pip install numba)")
    jit = functools.partial(nb.njit, nogil=True, cache=True)
    module = globals()
    module["prange"] = nb.prange
    module["_table_row"] = jit(_table_row)
    module["_project_item"] = jit(_project_item)
    code = _layer.__code__.replace(co_name="_layer_serial", co_qualname="_layer_serial")
    serial = types.FunctionType(code, module, "_layer_serial")
    return jit(parallel=True)(_layer), jit(serial)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of a: numba compiles a separate kernel for read-only arrays (a jax CPU buffer or a memory
    map), so every array the kernel only reads is passed read-only and one compiled kernel serves them all."""
    view = a.view()
    view.flags.writeable = False
    return view


def _scale_bits(scales: np.ndarray) -> np.ndarray:
    """The format's bf16 scales read in place as uint16 (their float32 value is the bits << 16)."""
    return np.ascontiguousarray(scales).view(np.uint16)


@dataclasses.dataclass(frozen=True)
class NumbaStack:
    """One MoE layer's experts for the numba kernel: byte-major bits (numpy, possibly memory maps) and their scales.
    Not a second format: two `PackedExperts` of the one format (layout "bytes"), paired with the numba kernel."""

    gate_up: PackedExperts  # [E, 2I, H]: gate = first I outputs
    down: PackedExperts  # [E, H, I]

    def __post_init__(self):
        check_pair(self.gate_up, self.down)
        if self.gate_up.layout != "bytes" or self.down.layout != "bytes":
            raise ValueError("the numba host kernel reads byte-major bits")

    @property
    def hidden(self) -> int:
        return self.down.out_features

    @functools.cached_property
    def _arrays(self) -> tuple:
        gu, dn = self.gate_up, self.down
        return tuple(_read_only(a) for a in (np.ascontiguousarray(gu.bits), _scale_bits(gu.scales),
                                               np.ascontiguousarray(dn.bits), _scale_bits(dn.scales)))

    def compute(self, x: np.ndarray, tasks: list, threads: int | None = None) -> np.ndarray:
        """The tasks of `expert_tasks` on rows x [T, H] float32 -> [T, H] float32 (rows without a pair 0), on
        `threads` numba threads (None: all of numba's)."""
        nb = _numba()
        out = np.zeros((x.shape[0], self.hidden), np.float32)
        if not tasks:
            return out
        pair_row = np.concatenate([ts for _, ts, _ in tasks]).astype(np.int64)
        pair_w = np.concatenate([w[:, 0] for _, _, w in tasks]).astype(np.float32)
        sizes = np.asarray([ts.size for _, ts, _ in tasks], np.int64)
        task_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        task_expert = np.asarray([e for e, _, _ in tasks], np.int64)
        threads = min(threads or nb.config.NUMBA_NUM_THREADS, nb.config.NUMBA_NUM_THREADS)
        gu_bits, gu_s, dn_bits, dn_s = self._arrays
        block_gu = _column_block(gu_bits.shape[3], len(tasks), threads)
        block_dn = _column_block(dn_bits.shape[3], len(tasks), threads)
        with _CALL_LOCK:
            parallel, serial = _kernels()
            layer = parallel if threads > 1 else serial
            nb.set_num_threads(threads)
            nb.set_parallel_chunksize(1)
            layer(_read_only(np.ascontiguousarray(x, np.float32)), pair_row, pair_w, task_start, task_expert, gu_bits,
                  gu_s, dn_bits, dn_s, self.gate_up.group, block_gu, block_dn, DENSE_MIN_TOKENS, out)
        return out

    def warm_up(self, max_tokens: int, threads: int | None = None) -> None:
        """Compiles the kernel that `threads` threads run (or loads it from numba's cache) by running one pair on
        zeros; `max_tokens` is accepted for the other kernels' interface (one build serves every token count)."""
        del max_tokens
        x = np.zeros((1, self.gate_up.in_features), np.float32)
        self.compute(x, [(0, np.zeros(1, np.intp), np.ones((1, 1), np.float32))], threads=threads)


def host_experts_numba(
    stack: NumbaStack,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    mask: np.ndarray,
    pool: concurrent.futures.Executor | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """`strata_jax.host.experts_numpy.host_experts` on a `NumbaStack`: the layer's masked pairs in one parallel numba
    call on `threads` threads (`pool` is not used: numba runs its own threads)."""
    del pool
    return stack.compute(np.asarray(x, np.float32), expert_tasks(ids, weights, mask), threads)

