"""The host-tier benchmarks run end to end on tiny shapes (no timings asserted)."""

import json

import numpy as np

from strata_jax.bench.main import main
from strata_jax.bench.tier import zipf_bias


def test_tier_mode_runs(tmp_path):
    out = tmp_path / "tier.json"
    assert main(["--mode", "tier", "--preset", "tiny", "--dtype", "float32", "--budgets", "all,quarter",
                 "--slots", "2", "--routing", "uniform,zipf", "--ctx", "64", "--fill", "8", "--steps", "2",
                 "--warm-steps", "4", "--placement-every", "2", "--host-kernel", "xla,numpy", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["budget"], r["routing"], r["host_kernel"]) for r in rows] == [
        ("all", "uniform", "-"), ("all", "zipf", "-"), ("quarter", "uniform", "xla"), ("quarter", "uniform", "numpy"),
        ("quarter", "zipf", "xla"), ("quarter", "zipf", "numpy")]
    assert rows[0]["gpu_experts"] == 16 and rows[0]["hit_rate"] == 1.0
    assert rows[2]["gpu_experts"] == 4 and 0.0 <= rows[2]["hit_rate"] < 1.0
    assert all(r["tok_s"] > 0 for r in rows)
    # Host time and pairs are counted where experts live on the host, and only there.
    assert rows[0]["host_ms"] == 0 and rows[0]["host_pairs"] == 0
    assert all(r["host_ms"] > 0 and r["host_calls"] > 0 and r["host_pairs"] > 0 for r in rows[2:])


def test_users_mode_reports_hit_rate(tmp_path):
    out = tmp_path / "users.json"
    common = ["--mode", "users", "--preset", "tiny", "--dtype", "float32", "--users", "1", "--prompt-tokens", "8",
              "--gen-tokens", "4", "--draft", "none", "--bandwidth-gib", "0.01", "--json", str(out)]
    assert main(common + ["--gpu-experts", "4", "--routing", "zipf"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert 0.0 <= row["gpu_hit_rate"] < 1.0 and row["routing"] == "zipf"
    # A budget the tiny model fits in whole: the planner keeps every expert on the device.
    assert main(common + ["--vram-budget-mib", "64", "--vram-reserve-mib", "0"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gpu_hit_rate"] == 1.0


def test_zipf_bias_is_a_permuted_zipf():
    b = zipf_bias(64, 1.0, seed=3)
    p = np.sort(np.exp(b))[::-1]
    assert abs(p.sum() - 1) < 1e-5
    np.testing.assert_allclose(p / p[0], 1.0 / np.arange(1, 65), rtol=1e-5)
    assert not np.all(np.diff(b) <= 0)  # permuted, not in rank order


def test_host_mode_times_each_kernel(tmp_path):
    out = tmp_path / "host.json"
    assert main(["--mode", "host", "--preset", "tiny", "--host-kernel", "xla,numpy", "--host-pairs", "1:2,3:5",
                 "--steps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["host_kernel"], r["tokens"], r["pairs"]) for r in rows] == [
        ("xla", 1, 2), ("xla", 3, 5), ("numpy", 1, 2), ("numpy", 3, 5)]
    assert all(r["layer_ms"] > 0 for r in rows)


def test_roundtrip_mode_times_each_way(tmp_path):
    out = tmp_path / "rt.json"
    assert main(["--mode", "roundtrip", "--preset", "tiny", "--host-pairs", "1:2", "--steps", "2",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["tokens"], row["pairs"]) == (1, 2)
    assert all(row[f"{m}_ms"] > 0 for m in ("device", "noop", "serial", "split"))
