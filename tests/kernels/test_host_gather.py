"""`pallas_kernels.host_gather.gather_rows`: rows of a table in pinned host memory gathered into device memory by
device-side ids, in both forms (the per-row slices and the Pallas kernel, interpret mode off a GPU), against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.host_gather import IMPLS, gather_rows, gather_rows_pallas, resolve_impl
from strata_jax.model.config import STREAM_COPIES


def _host(rows: np.ndarray) -> jax.Array:
    return jax.device_put(rows, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


@pytest.mark.parametrize("experts,words", [(5, 3), (16, 300), (8, 4101)])  # W below, off and across blocks
@pytest.mark.parametrize("impl", ["slices", "pallas"])
def test_live_rows_equal_numpy(experts, words, impl):
    rows = np.random.default_rng(words).integers(0, 2**32, (experts, words), dtype=np.uint32)
    ids = np.array([experts - 1, -1, 0, 2, -1, 2], np.int32)  # dead rows, a repeat, the first and last row
    out = np.asarray(jax.jit(lambda t, i: gather_rows(t, i, impl=impl))(_host(rows), jnp.asarray(ids)))
    live = ids >= 0
    assert out.shape == (len(ids), words) and out.dtype == np.uint32
    np.testing.assert_array_equal(out[live], rows[ids[live]])
    if impl == "pallas":  # a dead row's loads are masked off: it reads nothing and comes out as zeros
        assert not out[~live].any()


def test_small_blocks_cover_every_word():
    """Blocks smaller than a row (the real rows are 172,800 words in blocks of 2,048): every block lands in place,
    the last one partial."""
    rows = np.arange(4 * 1000, dtype=np.uint32).reshape(4, 1000)
    out = gather_rows_pallas(_host(rows), jnp.asarray([3, 1], jnp.int32), block=128,
                             interpret=jax.default_backend() != "gpu")
    np.testing.assert_array_equal(np.asarray(out), rows[[3, 1]])


def test_impl_choice():
    assert resolve_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "slices")  # CPU: no kernel
    assert resolve_impl("pallas") == "pallas"
    assert IMPLS == STREAM_COPIES  # the JAX-free config validates against its own copy of the list
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("dma")
