"""Routed experts on the host, compiled by XLA:CPU: the byte-table formulation of `strata_jax.host.experts_numpy`
(its reference; see its docstring for the maths) as one small jitted program per (expert, token bucket).

Why a second implementation: on the H200 machine's 16-core host (2026-11-29; docs/PERF.md "Host expert tier",
`python -m strata_jax.bench --mode host`) one layer's host work takes 2.2-2.8x less time than with numpy (3 pairs
of one token 1.49 ms against 3.26; 40 pairs of 8 tokens 10.6 against 29.8 ms), and one pair on one thread 0.77 ms
against 1.45: numpy's path is many mid-sized calls that hand the GIL around, while an XLA executable runs without
it.

Layout: the weight bits are *byte-major*, ``uint8 [E, P, K/8, N]`` (`words_to_bytes`), row ``4w + b`` = byte ``b`` of
packed word ``w`` = inputs ``32w + 8b .. 32w + 8b + 7`` (bit j = input ``32w + 8b + j``), so one byte row indexes one
256-entry row of the token's sign table and the gather is a plain ``take_along_axis``.

A few tokens on one expert (decode, verify) gather from tables; many (prefill) unpack each plane's signs to float32
once and multiply (`DENSE_MIN_TOKENS`). Token counts are padded to powers of two, so there are a handful of compiled
shapes per layer shape (compiled on first use, ~0.3 s each; `warm_up` compiles them ahead)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.host.experts_numpy import expert_tasks

# From this many tokens on one expert (after padding to a power of two), unpack-and-multiply beats the tables. One
# expert at Flash-Next shapes on this repository's CPU (2026-11-29), tables / dense ms: 1 token 0.50 / 1.40, 4 tokens
# 1.01 / 1.95, 8 tokens 1.87 / 2.77, 16 tokens 3.53 / 2.61.
DENSE_MIN_TOKENS = 16
_SIGNS = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.float32) * 2.0 - 1.0  # [256, 8]


def words_to_bytes(bits: np.ndarray) -> np.ndarray:
    """Packed words uint32 [..., K/32, N] -> byte-major uint8 [..., K/8, N] (row 4w + b = byte b of word w)."""
    *lead, kw, n = bits.shape
    b8 = np.asarray(bits).view(np.uint8).reshape(*lead, kw, n, 4)
    return np.ascontiguousarray(np.swapaxes(b8, -1, -2)).reshape(*lead, kw * 4, n)


def bytes_to_words(byts: np.ndarray) -> np.ndarray:
    """The inverse of `words_to_bytes`: uint8 [..., K/8, N] -> uint32 [..., K/32, N]."""
    *lead, rows, n = byts.shape
    b4 = np.asarray(byts).reshape(*lead, rows // 4, 4, n)
    return np.ascontiguousarray(np.swapaxes(b4, -1, -2)).view(np.uint32).reshape(*lead, rows // 4, n)


def _project_tables(x: jax.Array, byts: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    """x [t, K] float32, byts uint8 [P, K/8, N], scales [P, groups, N] -> [t, N] by sign tables and gathers."""
    planes, rows, n = byts.shape
    bpg = group // 8

    def one(xt):
        table = xt.reshape(rows, 8) @ jnp.asarray(_SIGNS).T  # [rows, 256]: x . signs of each byte value
        vals = jax.vmap(lambda b: jnp.take_along_axis(table, b.astype(jnp.int32), axis=1))(byts)  # [P, rows, N]
        full = rows // bpg
        sums = vals[:, : full * bpg].reshape(planes, full, bpg, n).sum(2)
        if full * bpg < rows:  # a short last group
            sums = jnp.concatenate([sums, vals[:, full * bpg :].sum(1, keepdims=True)], axis=1)
        return (sums * scales.astype(jnp.float32)).sum((0, 1))

    return jax.vmap(one)(x)


def _project_dense(x: jax.Array, byts: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    """`_project_tables` for many tokens: each plane's signs unpacked to float32 [K, N], scaled, multiplied."""
    planes, rows, n = byts.shape
    k = rows * 8
    bits = (byts[:, :, None, :] >> jnp.arange(8, dtype=jnp.uint8)[None, None, :, None]) & 1  # [P, rows, 8, N]
    signs = bits.reshape(planes, k, n).astype(jnp.float32) * 2.0 - 1.0
    scale = jnp.repeat(scales.astype(jnp.float32), group, axis=1)[:, :k]  # [P, K, N]
    return x @ (signs * scale).sum(0)


def _expert(x, gu_b, gu_s, dn_b, dn_s, group: int, dense: bool):
    project = _project_dense if dense else _project_tables
    gu = project(x, gu_b, gu_s, group)
    inter = gu.shape[1] // 2
    return project(jax.nn.silu(gu[:, :inter]) * gu[:, inter:], dn_b, dn_s, group)


@functools.partial(jax.jit, static_argnames=("group", "dense"))
def expert_rows(x, e, gu_b, gu_s, dn_b, dn_s, *, group: int, dense: bool) -> jax.Array:
    """down_e(silu(gate_e x) * up_e x) for rows x [t, H] float32 of expert e of the byte-major stacks -> [t, H]."""
    sel = functools.partial(jax.lax.dynamic_index_in_dim, index=e, keepdims=False)
    return _expert(x, sel(gu_b), sel(gu_s), sel(dn_b), sel(dn_s), group, dense)


def _bucket(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class XlaStack:
    """One MoE layer's experts as XLA:CPU arrays: byte-major bits (`words_to_bytes`) and bf16 scales."""

    gate_up_bytes: jax.Array  # uint8 [E, P, H/8, 2I]
    gate_up_scales: jax.Array  # bf16 [E, P, ceil(H/g), 2I]
    down_bytes: jax.Array  # uint8 [E, P, I/8, H]
    down_scales: jax.Array  # bf16 [E, P, ceil(I/g), H]
    group: int

    @property
    def hidden(self) -> int:
        return self.down_bytes.shape[-1]

    def expert_output(self, e: int, x: np.ndarray) -> np.ndarray:
        """Expert e on rows x [t, H] -> float32 [t, H] (rows padded to a power of two for the compiled shape)."""
        t = x.shape[0]
        padded = np.zeros((_bucket(t), x.shape[1]), np.float32)
        padded[:t] = x
        y = expert_rows(padded, np.int32(e), self.gate_up_bytes, self.gate_up_scales, self.down_bytes,
                        self.down_scales, group=self.group, dense=padded.shape[0] >= DENSE_MIN_TOKENS)
        return np.asarray(y)[:t]

    def warm_up(self, max_tokens: int) -> None:
        """Compiles every token bucket up to `max_tokens` (run on zeros; the outputs are discarded)."""
        for t in sorted({_bucket(n) for n in range(1, max_tokens + 1)}):
            self.expert_output(0, np.zeros((t, self.gate_up_bytes.shape[2] * 8), np.float32))


def host_experts_xla(
    stack: XlaStack,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    mask: np.ndarray,
    pool: concurrent.futures.Executor | None = None,
) -> np.ndarray:
    """`strata_jax.host.experts_numpy.host_experts` on an `XlaStack`: one compiled call per distinct expert, run on
    `pool` when given (the calls drop the GIL while XLA computes)."""
    out = np.zeros((x.shape[0], stack.hidden), np.float32)
    tasks = expert_tasks(ids, weights, mask)
    if not tasks:
        return out
    x = np.asarray(x, np.float32)

    def run(task):
        e, ts, w = task
        return ts, w * stack.expert_output(e, x[ts])

    results = pool.map(run, tasks) if pool is not None and len(tasks) > 1 else map(run, tasks)
    for ts, y in results:
        out[ts] += y  # a token routes to an expert at most once
    return out
