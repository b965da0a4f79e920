"""`host_memory="mapped"`: rows in pinned host memory imported through DLPack as a device array
(strata_jax/model/host_mapped.py). On the CPU the import wraps a page-aligned buffer; on a GPU it wraps memory the
driver mapped for the device, and must not take device memory for the table."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.host_gather import gather_rows
from strata_jax.model.config import ExpertQuantization
from strata_jax.model.expert_stream import resolve_host_memory, to_host_memory
from strata_jax.model.host_mapped import mapped_host_array


def _rows(e: int = 9, w: int = 300, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, size=(e, w), dtype=np.uint32)


def test_mapped_rows_read_back_exactly_as_device_memory():
    rows = _rows()
    table = mapped_host_array(rows)
    assert table.shape == rows.shape and table.dtype == jnp.uint32
    assert table.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(table), rows)
    ids = jnp.asarray([3, -1, 8, 0], jnp.int32)
    out = np.asarray(jax.jit(gather_rows)(table, ids))
    np.testing.assert_array_equal(out[[0, 2, 3]], rows[[3, 8, 0]])


def test_mapped_tables_are_freed_with_their_arrays():
    """Each table is released when jax frees its buffer (the DLPack deleter), and not before: a second array made
    from it stays readable after the first is gone."""
    from strata_jax.model import host_mapped

    live = len(host_mapped._LIVE)
    for seed in range(6):
        rows = _rows(seed=seed)
        table = mapped_host_array(rows)
        total = int(jax.jit(lambda t: jnp.sum((t[::2] % 7).astype(jnp.int32)))(table))
        assert total == int(np.sum(rows[::2] % 7))
        kept = jax.jit(lambda t: t + 0)(table)
        del table
        gc.collect()
        np.testing.assert_array_equal(np.asarray(kept), rows)
        del kept
    gc.collect()
    assert len(host_mapped._LIVE) == live


def test_bad_rows_and_names_are_clear_errors():
    with pytest.raises(ValueError, match="2-D uint32"):
        mapped_host_array(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="host_memory"):
        ExpertQuantization(host_memory="unified")
    with pytest.raises(ValueError, match="host_memory"):
        resolve_host_memory("device")
    assert resolve_host_memory("auto") == "pinned"  # until mapped is measured faster (expert_stream.AUTO_MAPPED)
    assert to_host_memory(_rows(), memory="mapped").sharding.memory_kind == "device"


@pytest.mark.gpu
def test_a_mapped_table_takes_no_device_memory():
    """256 MiB of rows imported: device memory in use grows by far less than the table (the bytes stay in host RAM)
    and the rows read back exactly through the Pallas copy."""
    device = jax.devices()[0]
    rows = np.random.default_rng(1).integers(0, 2**32, size=(384, 174_763), dtype=np.uint32)
    before = device.memory_stats()["bytes_in_use"]
    table = mapped_host_array(rows, device)
    grown = device.memory_stats()["bytes_in_use"] - before
    assert grown < rows.nbytes // 16, grown
    ids = jnp.asarray([383, -1, 7, 100], jnp.int32)
    out = np.asarray(jax.jit(lambda t, i: gather_rows(t, i, impl="pallas"))(table, ids))
    np.testing.assert_array_equal(out[[0, 2, 3]], rows[[383, 7, 100]])
