"""Routed experts on the host, compiled by XLA:CPU: the byte-table formulation of `strata_jax.host.experts_numpy`
(its reference; see its docstring for the maths) as one small jitted program per (expert, token bucket).

Why a second implementation: on the H200 machine's 16-core host (2026-11-29; docs/PERF.md "Host expert tier",
`python -m strata_jax.bench --mode host`) one layer's host work takes 2.2-2.8x less time than with numpy (3 pairs
of one token 1.49 ms against 3.26; 40 pairs of 8 tokens 10.6 against 29.8 ms), and one pair on one thread 0.77 ms
against 1.45: numpy's path is many mid-sized calls that hand the GIL around, while an XLA executable runs without
it.

Layout: the weight bits are the format's *byte-major* layout (`pallas_kernels.onebit_format`, "bytes"),
``uint8 [E, P, K/8, N]``, row ``4w + b`` = byte ``b`` of packed word ``w`` = inputs ``32w + 8b .. 32w + 8b + 7`` (bit j
= input ``32w + 8b + j``), so one byte row indexes one 256-entry row of the token's sign table and the gather is a
plain ``take_along_axis``.

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

from pallas_kernels.activations import silu
from pallas_kernels.onebit_format import PackedExperts, check_pair, dequantize_planes
from strata_jax.host.experts_numpy import BYTE_SIGNS, expert_tasks, run_tasks

# From this many tokens on one expert (after padding to a power of two), unpack-and-multiply beats the tables. One
# expert at Flash-Next shapes on this repository's CPU (2026-11-29), tables / dense ms: 1 token 0.50 / 1.40, 4 tokens
# 1.01 / 1.95, 8 tokens 1.87 / 2.77, 16 tokens 3.53 / 2.61.
DENSE_MIN_TOKENS = 16


def _project_tables(x: jax.Array, byts: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    """x [t, K] float32, byts uint8 [P, K/8, N], scales [P, groups, N] -> [t, N] by sign tables and gathers."""
    planes, rows, n = byts.shape
    bpg = group // 8

    def one(xt):
        table = xt.reshape(rows, 8) @ jnp.asarray(BYTE_SIGNS).T  # [rows, 256]: x . signs of each byte value
        vals = jax.vmap(lambda b: jnp.take_along_axis(table, b.astype(jnp.int32), axis=1))(byts)  # [P, rows, N]
        full = rows // bpg
        sums = vals[:, : full * bpg].reshape(planes, full, bpg, n).sum(2)
        if full * bpg < rows:  # a short last group
            sums = jnp.concatenate([sums, vals[:, full * bpg :].sum(1, keepdims=True)], axis=1)
        return (sums * scales.astype(jnp.float32)).sum((0, 1))

    return jax.vmap(one)(x)


def _project_dense(x: jax.Array, byts: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    """`_project_tables` for many tokens: the planes unpacked to one float32 [K, N] matrix, multiplied."""
    return x @ dequantize_planes(byts, scales, group)


@functools.partial(jax.jit, static_argnames=("dense",))
def expert_rows(x, e, gate_up: PackedExperts, down: PackedExperts, *, dense: bool) -> jax.Array:
    """down_e(silu(gate_e x) * up_e x) for rows x [t, H] float32 of expert e of the byte-major stacks -> [t, H]."""
    project = _project_dense if dense else _project_tables
    sel = functools.partial(jax.lax.dynamic_index_in_dim, index=e, keepdims=False)

    def apply(a: jax.Array, w: PackedExperts) -> jax.Array:
        return project(a, sel(w.bits), sel(w.scales), w.group)

    gu = apply(x, gate_up)
    inter = gu.shape[1] // 2
    return apply(silu(gu[:, :inter]) * gu[:, inter:], down)


def _bucket(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class XlaStack:
    """One MoE layer's experts as XLA:CPU arrays, byte-major bits. Not a second format: two `PackedExperts` of the
    one format (layout "bytes"), paired with the compiled kernel's compute."""

    gate_up: PackedExperts  # [E, 2I, H]: gate = first I outputs
    down: PackedExperts  # [E, H, I]

    def __post_init__(self):
        check_pair(self.gate_up, self.down)
        if self.gate_up.layout != "bytes" or self.down.layout != "bytes":
            raise ValueError("the XLA host kernel reads byte-major bits")

    @property
    def hidden(self) -> int:
        return self.down.out_features

    def expert_output(self, e: int, x: np.ndarray) -> np.ndarray:
        """Expert e on rows x [t, H] -> float32 [t, H] (rows padded to a power of two for the compiled shape)."""
        t = x.shape[0]
        padded = np.zeros((_bucket(t), x.shape[1]), np.float32)
        padded[:t] = x
        y = expert_rows(padded, np.int32(e), self.gate_up, self.down, dense=padded.shape[0] >= DENSE_MIN_TOKENS)
        return np.asarray(y)[:t]

    def warm_up(self, max_tokens: int) -> None:
        """Compiles every token bucket up to `max_tokens` (run on zeros; the outputs are discarded)."""
        for t in sorted({_bucket(n) for n in range(1, max_tokens + 1)}):
            self.expert_output(0, np.zeros((t, self.gate_up.in_features), np.float32))


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

    return run_tasks(run, tasks, out, pool)
