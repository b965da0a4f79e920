"""The kernel benchmark's timing loop must keep every layer's work: a layer whose output nobody reads is deleted by
XLA, which once made the kernel tables 3-4x too fast."""

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.bench.kernels import make_scan


@pytest.mark.parametrize("out_rows", [3, 5])  # the layer's own shape (whole-output chaining) or a part's shape
def test_scan_keeps_every_unrolled_layer(out_rows):
    unroll = 4

    def layer(x, ids, w, table):
        y = jnp.cos(x * table[0])
        return y if out_rows == x.shape[0] else jnp.concatenate([y, y[:2]])

    xs = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)), jnp.float32)
    ids = jnp.zeros((2, 3, 2), jnp.int32)
    ws = jnp.ones((2, 3, 2), jnp.float32)
    run = make_scan(layer, iters=8, layers=2, unroll=unroll)
    hlo = run.lower(xs, ids, ws, jnp.ones((4,), jnp.float32)).compile().as_text()
    assert hlo.count("cosine(") >= unroll, "unrolled layers were dead-code eliminated"


def test_once_mode_runs_each_variant_for_a_profiler(capsys):
    """`--once` (the workload for Nsight Compute) runs every named variant at every T, untimed, and exits 0."""
    from strata_jax.bench.kernels import main

    assert main(["--quick", "--once", "--variants", "auto,lut_g32_d32_b8"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "T=" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["auto T=1", "auto T=4", "lut_g32_d32_b8 T=1", "lut_g32_d32_b8 T=4"]
    assert all(float(ln.rsplit(" ", 1)[1]) > 0 for ln in lines)  # a real, non-zero output
    with pytest.raises(SystemExit, match="unknown: lut_nonsense"):
        main(["--quick", "--once", "--variants", "auto,lut_nonsense"])
