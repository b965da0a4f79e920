"""Streamed experts' rows in pinned host memory (`expert_stream.to_host_memory`, host_memory="pinned"): put there
directly under XLA's default allocator; under its VMM allocator (turned on by `--command-buffers stable-scratch`),
where a direct `device_put` into pinned host memory crashed the process on the H200, put on the device and moved
there by a jitted copy. Either way the rows read back exactly, and the gather the step runs reads them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.host_gather import gather_rows
from strata_jax.model import expert_stream
from strata_jax.model.expert_stream import host_memory_kind, to_host_memory, vmm_allocator

ROOT = Path(__file__).resolve().parents[2]
SKIP_TEMP = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"


def _rows(e: int = 12, w: int = 257) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 2**32, size=(e, w), dtype=np.uint32)


def test_the_vmm_allocator_is_read_from_xla_flags():
    assert vmm_allocator({"XLA_FLAGS": f"--xla_gpu_autotune_level=0 {SKIP_TEMP}"})
    assert not vmm_allocator({"XLA_FLAGS": "--xla_gpu_command_buffer_update_mode=ALWAYS"})
    assert not vmm_allocator({})


@pytest.mark.parametrize("flags", ["", SKIP_TEMP])
def test_rows_land_in_pinned_host_memory_exactly(flags, monkeypatch):
    if host_memory_kind() is None:
        pytest.skip(f"{jax.devices()[0].device_kind} offers no pinned host memory")
    monkeypatch.setenv("XLA_FLAGS", flags)  # read when the rows are placed, not by the running backend
    direct = []
    real_put = jax.device_put

    def put(x, sharding=None, **kw):
        direct.append(getattr(sharding, "memory_kind", None))
        return real_put(x, sharding, **kw)

    monkeypatch.setattr(expert_stream.jax, "device_put", put)
    rows = _rows()
    table = to_host_memory(rows, memory="pinned")
    assert table.sharding.memory_kind == "pinned_host"
    # The VMM path never puts host bytes straight into pinned memory; the default path does exactly that.
    assert ("pinned_host" in direct) == (not flags)
    np.testing.assert_array_equal(np.asarray(table), rows)
    ids = jnp.asarray([11, -1, 0, 5], jnp.int32)
    out = np.asarray(jax.jit(gather_rows)(table, ids))
    np.testing.assert_array_equal(out[[0, 2, 3]], rows[[11, 0, 5]])


@pytest.mark.gpu
def test_pinned_rows_under_the_vmm_allocator_on_a_gpu():
    """In a fresh process with the flag set (the allocator is chosen when the backend starts): rows placed by
    `to_host_memory` read back exactly through the Pallas copy. A direct device_put crashed here (segfault)."""
    code = (
        "import numpy as np, jax, jax.numpy as jnp\n"
        "from pallas_kernels.host_gather import gather_rows\n"
        "from strata_jax.model.expert_stream import to_host_memory\n"
        "rows = np.random.default_rng(0).integers(0, 2**32, size=(64, 172_800), dtype=np.uint32)\n"
        "tables = [to_host_memory(rows, memory='pinned') for _ in range(3)]\n"
        "ids = jnp.asarray([63, -1, 7, 0], jnp.int32)\n"
        "out = np.asarray(jax.jit(lambda t, i: gather_rows(t, i, impl='pallas'))(tables[2], ids))\n"
        "assert tables[2].sharding.memory_kind == 'pinned_host'\n"
        "assert (out[[0, 2, 3]] == rows[[63, 7, 0]]).all() and not out[1].any()\n"
        "print('exact')\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {SKIP_TEMP}".strip()}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("exact")
