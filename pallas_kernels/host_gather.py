"""Rows of a table kept in (pinned) host memory gathered into device memory inside a jitted step, by row ids that
live on the device (a MoE layer's missing experts, `strata_jax.model.expert_stream`).

    out[s] = table[ids[s]]   for ids[s] >= 0;   rows with ids[s] < 0 are dead: their contents are unspecified

Two forms:

* ``"slices"`` (the reference and the fallback): one ``lax.dynamic_slice_in_dim`` + ``jax.device_put`` to device
  memory per row. XLA accepts a slice of a host-memory array where it refuses a gather; every row is copied, a dead
  one copying row 0, since shapes are fixed.
* ``"pallas"`` (``"auto"`` on a GPU): one Pallas kernel (Triton lowering) that reads the host table directly,
  pinned host memory being addressable from the GPU: grid ``(rows, row words / block)``, each program loads one
  block of its row and stores it, a dead row's loads masked off so that its bytes never cross PCIe. One launch per
  call instead of one copy per row, and no bytes for dead rows. XLA hands the kernel the host buffer as it is (no
  copy of the table in the compiled module). On the H200 (2026-12-03, 48 chained calls of 10 rows of 691 KB from a
  pinned [165, 172800] table): 2.61 ms with 3 live rows per call (38 GB/s of live rows), 7.29 ms with 10 (46 GB/s),
  0.52 ms with none, against 9.3-9.5 ms for the slices whatever the live count (docs/PERF.md, "Streamed experts").

On the CPU backend host and device memory are the same memory; the kernel runs in interpret mode there (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

IMPLS = ("auto", "slices", "pallas")
AUTO_PALLAS = True  # "auto" -> "pallas" on a GPU: faster than the slices at every live-row count (above)
BLOCK = 2048  # uint32 words a program moves: 8 KB, 16 words per thread at 4 warps


def gather_rows_slices(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [E, W] (any memory kind), ids [S] int32 -> [S, W] in device memory: one slice and device_put per row
    (dead rows copy row 0)."""
    rows = [jax.device_put(jax.lax.dynamic_slice_in_dim(table, jnp.maximum(ids[j], 0), 1, 0),
                           jax.memory.Space.Device) for j in range(ids.shape[0])]
    return jnp.concatenate(rows, axis=0)


def _gather_kernel(ids_ref, table_ref, out_ref, *, block: int, words: int):
    s, j = pl.program_id(0), pl.program_id(1)
    row = ids_ref[s]
    col = j * block
    in_row = (col + jnp.arange(block) < words)[None, :]
    # A dead row's loads are all masked: nothing is read from the host for it.
    values = pltriton.load(table_ref.at[pl.ds(jnp.maximum(row, 0), 1), pl.ds(col, block)],
                           mask=in_row & (row >= 0), other=0)
    pltriton.store(out_ref.at[pl.ds(s, 1), pl.ds(col, block)], values, mask=in_row)


def gather_rows_pallas(table: jax.Array, ids: jax.Array, *, block: int = BLOCK, num_warps: int = 4,
                       interpret: bool = False) -> jax.Array:
    """The Pallas form of `gather_rows` (dead rows come out as zeros)."""
    e, w = table.shape
    s = ids.shape[0]
    block = min(block, pl.next_power_of_2(w))
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=1)}
    return pl.pallas_call(
        functools.partial(_gather_kernel, block=block, words=w),
        grid=(s, pl.cdiv(w, block)),
        out_shape=jax.ShapeDtypeStruct((s, w), table.dtype),
        interpret=interpret,
        **kwargs,
    )(ids.astype(jnp.int32), table)


def resolve_impl(impl: str) -> str:
    """"auto" -> the form this backend runs ("pallas" only on a GPU and once measured faster)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "pallas" if AUTO_PALLAS and jax.default_backend() == "gpu" else "slices"
    return impl


def gather_rows(table: jax.Array, ids: jax.Array, *, impl: str = "auto") -> jax.Array:
    """table [E, W] (typically in pinned host memory), ids [S] int32 (< 0: a dead row) -> [S, W] in device memory,
    row s = table[ids[s]] for live rows; dead rows unspecified. `impl`: see the module docstring."""
    impl = resolve_impl(impl)
    if impl == "slices":
        return gather_rows_slices(table, ids)
    return gather_rows_pallas(table, ids, interpret=jax.default_backend() != "gpu")
