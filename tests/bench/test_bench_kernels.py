"""The kernel benchmark's timing loop must keep every layer's work: a layer whose output nobody reads is deleted by
XLA, which once made the kernel tables 3-4x too fast. Its bf16 baselines compute the layer, and every row carries
the compute floor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.bench import kernels
from strata_jax.bench.kernels import bf16_layer, compiled_flops, make_scan, padded_layer, ragged_layer


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


@pytest.mark.parametrize("layer", ["ragged", "padded"])
def test_grouped_bf16_baselines_match_the_gather_baseline(layer):
    """The grouped bf16 baselines ([E, K, N] experts, pairs sorted by expert) compute what the gather-einsum does on
    the [E, N, K] copies, for ids offset by a layer copy as the scan offsets them; uneven expert loads, one empty."""
    rng = np.random.default_rng(0)
    n_exp, hidden, inter, t, k = 6, 64, 32, 9, 3
    gu = jnp.asarray(rng.standard_normal((n_exp, 2 * inter, hidden)) * 0.1, jnp.bfloat16)
    dn = jnp.asarray(rng.standard_normal((n_exp, hidden, inter)) * 0.1, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((t, hidden)), jnp.bfloat16)
    ids = np.stack([rng.choice(5, k, replace=False) for _ in range(t)]).astype(np.int32)  # expert 5 unused
    ids[:, 0] = 2  # expert 2 in every token
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    want = np.asarray(bf16_layer(x, jnp.asarray(ids), w, gu, dn), np.float32)
    gu_t, dn_t = jnp.swapaxes(gu, 1, 2), jnp.swapaxes(dn, 1, 2)
    fn = ragged_layer if layer == "ragged" else lambda *a: padded_layer(*a, capacity=16)
    got = np.asarray(jax.jit(fn)(x, jnp.asarray(ids + n_exp), w, gu_t, dn_t), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_compiled_flops_count_a_matmul():
    """The measure that keeps a densely expanded ragged_dot (E x the work) out of the GPU runs."""
    a, b = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 32), jnp.bfloat16)
    assert compiled_flops(lambda x, y: x @ y, (a, b)) == pytest.approx(2 * 64 * 128 * 32, rel=0.05)


def test_prefill_variants_and_bf16_baselines_against_the_compute_floor(capsys):
    """A grouped prefill variant (64-row blocks, interpret mode), its per-kernel parts and the bf16 baselines are
    checked against the XLA path, timed, and given the compute floor: the routed FLOPs over the measured rate."""
    names = ["grouped_m64_n128_w4", "ragged_bf16", "padded_bf16"]
    out = kernels.main(["--quick", "--planes", "1", "--tokens", "8", "--variants", ",".join(names),
                        "--parts", "grouped_m64_n128_w4"])
    assert sorted(c["variant"] for c in out["checks"] if c["ok"]) == sorted(names)
    (row,) = out["results"]
    parts = ["grouped_m64_n128_w4@gu", "grouped_m64_n128_w4@dn"]
    assert sorted(row["times_us"]) == sorted(names + parts)
    flops = 8 * 10 * (2 * 256 * 2 * 64 + 2 * 64 * 256)  # T * k * (gate_up + down) at the --quick shapes
    assert row["compute_floor_us"] == pytest.approx(flops / (out["info"]["matmul_TFLOPs"] * 1e12) * 1e6)
    for name in names:
        assert row["pct_of_compute_floor"][name] == pytest.approx(100 * row["compute_floor_us"]
                                                                  / row["times_us"][name])
    assert row["pct_of_compute_floor"][parts[0]] == pytest.approx(
        100 * row["compute_floor_us"] * 2 / 3 / row["times_us"][parts[0]])
    text = capsys.readouterr().out
    assert "cfloor" in text and "% of the compute floor" in text
    with pytest.raises(SystemExit, match="unknown variants: grouped_m64_nope"):  # before any device time is spent
        kernels.main(["--quick", "--variants", "ragged_bf16,grouped_m64_nope"])


def test_prefill_variants_lower_to_triton_at_flash_next_shapes():
    """The grouped_m* sweep (32-128 rows per block) passes the Pallas -> Triton lowering at the real widths, which
    interpret mode skips (power-of-two blocks, dot shapes); compiling them still needs the GPU."""
    import pallas_kernels as pk
    from strata_jax.bench.kernels import VARIANTS, random_packed

    kg, kd = jax.random.split(jax.random.PRNGKey(0))
    gu, dn = random_packed(kg, 16, 1280, 2560, 1, 128), random_packed(kd, 16, 2560, 640, 1, 128)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, 10, replace=False) for _ in range(512)]).astype(np.int32)
    w = np.full((512, 10), 0.1, np.float32)
    x = jnp.ones((512, 2560), jnp.bfloat16)
    names = [n for n in VARIANTS if n.startswith("grouped_m")]
    assert len(names) >= 8
    for name in names:
        cfg = VARIANTS[name][1]
        assert cfg.bm >= 32
        f = jax.jit(lambda *a, cfg=cfg: pk.moe_experts_1bit(*a, impl="pallas", config=cfg))
        text = f.trace(x, ids, w, gu, dn).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2, name  # the gate_up and the down kernel
