"""Routed experts on the host, in numpy, straight from the packed 1-bit bytes (checkpoints/README.md, "Packed
expert format"): no float32 copy of any weight matrix is ever made.

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

The gate_up table depends on the token only, so it is shared by all of a token's host experts; the down
table is built per (token, expert) from the activation. The tables cost ~1 ns per gather, linear in the tokens:
an expert that receives several tokens at once (prefill) instead goes through `project_blocked`, which unpacks
one scale group's bits at a time to a small float32 block for BLAS. Experts are independent tasks: `host_experts`
runs them on a thread pool (numpy drops the GIL in take/sum/matmul).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

WORD_BITS = 32
# From this many tokens on one expert, `project_blocked` (BLAS on one unpacked scale group at a time) beats the
# byte tables (measured crossover ~3 tokens at Flash-Next shapes, numpy 2.4, 2026-11-29).
BLOCKED_MIN_TOKENS = 4
# BITS[v, j] = bit j of v (LSB first): the 0/1 masks of the 256 possible bytes.
_BITS = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.float32)


def byte_tables(x: np.ndarray) -> np.ndarray:
    """x [T, K] float32 -> lut [T, K/8 * 256] float32: lut[t, c*256 + v] = sum of x[t, 8c + j] over the set
    bits j of v."""
    t, k = x.shape
    return (x.reshape(t, k // 8, 8) @ _BITS.T).reshape(t, (k // 8) * 256)


@dataclasses.dataclass(frozen=True)
class _Offsets:
    """Per-shape constant: the table offset of every weight byte, in input-byte-major order [kw*4, n]
    (row 4w + b is byte b of word w, i.e. inputs 32w + 8b .. 32w + 8b + 7)."""

    base: np.ndarray  # intp [kw, 4, n]


_OFFSETS: dict[tuple[int, int], _Offsets] = {}


def _offsets(kw: int, n: int) -> _Offsets:
    if (kw, n) not in _OFFSETS:
        rows = np.arange(kw)[:, None, None] * 4 + np.arange(4)[None, :, None]
        _OFFSETS[kw, n] = _Offsets(np.broadcast_to(rows * 256, (kw, 4, n)).astype(np.intp))
    return _OFFSETS[kw, n]


def _sum_groups(masked: np.ndarray, bytes_per_group: int) -> np.ndarray:
    """[T, C, N] per-byte sums -> [T, ceil(C / bytes_per_group), N] per-group sums (the last group may be short).
    A reshape-sum over a middle axis vectorises over N; np.add.reduceat is ~8x slower here."""
    t, c, n = masked.shape
    full = c // bytes_per_group
    out = masked[:, : full * bytes_per_group].reshape(t, full, bytes_per_group, n).sum(axis=2)
    if c % bytes_per_group:
        out = np.concatenate([out, masked[:, full * bytes_per_group :].sum(axis=1, keepdims=True)], axis=1)
    return out


def project(lut: np.ndarray, xsum: np.ndarray, bits: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """One expert's projection of T tokens from their byte tables.

    lut [T, K/8*256] (`byte_tables`), xsum [T, groups] (sum of x per scale group), bits uint32 [P, K/32, N],
    scales [P, groups, N] (any float dtype) -> y float32 [T, N]."""
    planes, kw, n = bits.shape
    base = _offsets(kw, n).base
    y = np.zeros((lut.shape[0], n), np.float32)
    for p in range(planes):
        # The 4 bytes of each word, read in place and laid out input-byte-major, plus their table offsets.
        idx = (base + bits[p].view(np.uint8).reshape(kw, n, 4).transpose(0, 2, 1)).reshape(kw * 4, n)
        masked = np.take(lut, idx, axis=1)  # [T, K/8, N]: x summed over the set bits of each weight byte
        per_group = _sum_groups(masked, group // 8)  # [T, groups, N]
        sc = scales[p].astype(np.float32)
        y += 2.0 * np.einsum("tgn,gn->tn", per_group, sc) - xsum @ sc
    return y


def project_blocked(x: np.ndarray, xsum: np.ndarray, bits: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """`project` for many tokens of one expert (prefill): one scale group at a time, the 0/1 bits of the group are
    unpacked to a float32 block [group, N] (never the whole matrix) and multiplied by BLAS, so the cost hardly grows
    with the tokens, where the table gathers grow linearly (crossover ~3 tokens at Flash-Next shapes).

    x [T, K] float32, xsum [T, groups], bits uint32 [P, K/32, N], scales [P, groups, N] -> y float32 [T, N]."""
    planes, kw, n = bits.shape
    wpg = group // WORD_BITS
    y = np.zeros((x.shape[0], n), np.float32)
    for p in range(planes):
        b8 = bits[p].view(np.uint8).reshape(kw, n, 4)
        for g, w0 in enumerate(range(0, kw, wpg)):
            w1 = min(kw, w0 + wpg)
            ones = np.unpackbits(b8[w0:w1], axis=-1, bitorder="little")  # [words, n, 32]: bit j = input 32w + j
            block = ones.transpose(0, 2, 1).reshape((w1 - w0) * WORD_BITS, n).astype(np.float32)
            masked = x[:, w0 * WORD_BITS : w1 * WORD_BITS] @ block
            y += scales[p, g].astype(np.float32) * (2.0 * masked - xsum[:, g : g + 1])
    return y


def group_sums(x: np.ndarray, group: int) -> np.ndarray:
    """x [T, K] -> [T, ceil(K / group)] sums of x per scale group."""
    return np.add.reduceat(x, np.arange(0, x.shape[1], group), axis=1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@dataclasses.dataclass(frozen=True)
class PackedStack:
    """One MoE layer's packed experts as host numpy arrays (all E experts; possibly memory maps)."""

    gate_up_bits: np.ndarray  # uint32 [E, P, H/32, 2I]
    gate_up_scales: np.ndarray  # bf16 [E, P, ceil(H/g), 2I]
    down_bits: np.ndarray  # uint32 [E, P, I/32, H]
    down_scales: np.ndarray  # bf16 [E, P, ceil(I/g), H]
    group: int

    @property
    def num_experts(self) -> int:
        return self.gate_up_bits.shape[0]

    @property
    def hidden(self) -> int:
        return self.down_bits.shape[-1]

    def expert_output(self, e: int, x: np.ndarray, lut: np.ndarray, xsum: np.ndarray) -> np.ndarray:
        """down_e(silu(gate_e x) * up_e x) for rows x [T, H] (with their gate_up tables) -> [T, H] float32.
        Few rows use the byte tables, many (prefill) the blocked BLAS path."""
        inter = self.down_bits.shape[2] * WORD_BITS
        g = self.group
        if x.shape[0] < BLOCKED_MIN_TOKENS:
            gu = project(lut, xsum, self.gate_up_bits[e], self.gate_up_scales[e], g)
            act = silu(gu[:, :inter]) * gu[:, inter:]
            return project(byte_tables(act), group_sums(act, g), self.down_bits[e], self.down_scales[e], g)
        gu = project_blocked(x, xsum, self.gate_up_bits[e], self.gate_up_scales[e], g)
        act = silu(gu[:, :inter]) * gu[:, inter:]
        return project_blocked(act, group_sums(act, g), self.down_bits[e], self.down_scales[e], g)


def host_experts(
    stack: PackedStack,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    mask: np.ndarray,
    pool: concurrent.futures.Executor | None = None,
) -> np.ndarray:
    """sum over the pairs (t, j) with mask[t, j] of weights[t, j] * expert_{ids[t, j]}(x[t]).

    x [T, H] float32, ids [T, k] int, weights [T, k], mask [T, k] bool -> [T, H] float32 (rows without a
    masked pair are 0). One task per distinct expert, run on `pool` when given."""
    out = np.zeros((x.shape[0], stack.hidden), np.float32)
    rows_any = np.flatnonzero(mask.any(axis=1))
    if rows_any.size == 0:
        return out
    xr = np.ascontiguousarray(x[rows_any], np.float32)
    lut = byte_tables(xr)
    xsum = group_sums(xr, stack.group)
    local = np.full(x.shape[0], -1, np.intp)
    local[rows_any] = np.arange(rows_any.size)
    t_idx, j_idx = np.nonzero(mask)
    experts = ids[t_idx, j_idx]
    order = np.argsort(experts, kind="stable")
    t_idx, j_idx, experts = t_idx[order], j_idx[order], experts[order]
    bounds = np.flatnonzero(np.diff(experts)) + 1
    tasks = []
    for ts, js in zip(np.split(t_idx, bounds), np.split(j_idx, bounds)):
        e = int(ids[ts[0], js[0]])
        rows = local[ts]
        w = weights[ts, js].astype(np.float32)[:, None]
        tasks.append((e, ts, rows, w))

    def run(task):
        e, ts, rows, w = task
        return ts, w * stack.expert_output(e, xr[rows], lut[rows], xsum[rows])

    results = pool.map(run, tasks) if pool is not None and len(tasks) > 1 else map(run, tasks)
    for ts, y in results:
        out[ts] += y  # a token routes to an expert at most once
    return out
