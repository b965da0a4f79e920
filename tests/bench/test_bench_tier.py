"""The host-tier benchmarks run end to end on tiny shapes (no timings asserted)."""

import json

import numpy as np
import pytest

from strata_jax.bench.main import main
from strata_jax.bench.synthetic import preset_config
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
    # The device's share (steps back to back) and the launches: no command buffers on the CPU, so each kernel is
    # a launch; the host-compute tier adds its callbacks' kernels to the all-resident step's.
    assert all(r["chained_ms"] > 0 and r["command_buffers"] == 0 and r["host_launches"] == r["kernels"] > 0
               for r in rows)
    assert rows[2]["kernels"] > rows[0]["kernels"]


def test_tier_mode_streams_beside_host_compute(tmp_path, capsys):
    """`--host-path stream` with `--compute-budgets`, `--copy-slots auto,1`, `--stream-copy slices,pallas` and
    `--prefill-tokens`: at a quarter budget the streamed model serves the same pool hits and misses as the
    host-compute baseline with no host callbacks; one staging row per round copies exactly the missing experts,
    while auto's slices copy its fixed staging every step and auto's kernel only the rows that hold a missing
    expert; each prompt chunk stages every expert outside the pool, whatever the decode copy slots; the
    all-resident model streams nothing."""
    out = tmp_path / "tier.json"
    assert main(["--mode", "tier", "--preset", "tiny", "--dtype", "float32", "--budgets", "all,quarter",
                 "--slots", "1", "--routing", "uniform,zipf", "--ctx", "64", "--fill", "8", "--steps", "2",
                 "--warm-steps", "4", "--placement-every", "2", "--host-path", "stream", "--compute-budgets",
                 "quarter", "--copy-slots", "auto,1", "--stream-copy", "slices,pallas", "--prefill-tokens", "32",
                 "--prefill-chunk", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    decode = [r for r in rows if "tok_s" in r]
    forms = [("auto", "pallas"), ("auto", "slices"), (1, "pallas"), (1, "slices")]
    assert [(r["budget"], r["host_path"], r["copy_slots"], r["stream_copy"], r["routing"]) for r in decode] == [
        ("all", "none", "auto", "auto", "uniform"), ("all", "none", "auto", "auto", "zipf"),
        ("quarter", "compute", "auto", "auto", "uniform"), ("quarter", "compute", "auto", "auto", "zipf"),
        *[("quarter", "stream", c, f, routing) for c, f in forms for routing in ("uniform", "zipf")]]
    resident, compute, streamed = decode[:2], decode[2:4], decode[4:]
    auto_kernel, auto_slices, one_kernel, one_slices = (streamed[i:i + 2] for i in range(0, 8, 2))
    assert all(r["gpu_experts"] == 16 and r["hit_rate"] == 1.0 and r["streamed_mb"] == 0 and r["host_pairs"] == 0
               for r in resident)
    assert all(r["gpu_experts"] == 4 and 0.0 <= r["hit_rate"] < 1.0 for r in compute + streamed)
    assert all(r["host_calls"] > 0 and r["host_pairs"] > 0 and r["streamed_mb"] == 0 and r["staged_experts"] == 0
               for r in compute)
    # Streaming takes the host's place: no callbacks, and the same routed pairs hit and miss the pool (outputs and
    # placement unchanged), for every staging size and copy form. One slot's missed pairs are distinct experts:
    # each staged once.
    assert all(r["host_calls"] == 0 and r["host_ms"] == 0 and r["streamed_mb"] > 0 for r in streamed)
    for i, c in enumerate(compute):
        assert all(r["hit_rate"] == c["hit_rate"] and r["staged_experts"] == r["host_pairs"] == c["host_pairs"] > 0
                   for r in streamed[i::2])
    # One staging row per round (overflow rounds for the rest), or the kernel at any staging size: the bytes are
    # exactly the staged experts' rows. Auto's slices copy every staging row each step, filled or not.
    cfg = preset_config("tiny")
    layers = cfg.num_layers - len(cfg.dense_mlp_layers)
    row_mb = one_slices[0]["streamed_mb"] / one_slices[0]["staged_experts"]
    for r in one_slices + one_kernel + auto_kernel:
        assert r["streamed_mb"] == pytest.approx(r["staged_experts"] * row_mb)
    assert all(r["streamed_mb"] == pytest.approx(layers * cfg.num_experts_per_tok * row_mb) for r in auto_slices)
    assert all(a["streamed_mb"] > o["streamed_mb"] for a, o in zip(auto_slices, auto_kernel))
    # A prompt on every all-resident and streaming model (not the host-compute one): every chunk stages all 12
    # experts outside the pool in each layer; the kernel moves only those a chunk's tokens route to.
    prefill = [r for r in rows if "ttft_s" in r]
    assert [(r["budget"], r["host_path"], r["copy_slots"], r["stream_copy"]) for r in prefill] == [
        ("all", "none", "auto", "auto"), *[("quarter", "stream", c, f) for c, f in forms]]
    assert all(r["prefill_tokens"] == 32 and r["prefill_chunk"] == 16 and r["ttft_s"] > 0 for r in prefill)
    assert prefill[0]["prefill_streamed_mb"] == 0
    every_row = 2 * layers * (16 - 4) * row_mb
    for r in prefill[1:]:
        if r["stream_copy"] == "slices":
            assert r["prefill_streamed_mb"] == pytest.approx(every_row)
        else:
            assert 0 < r["prefill_streamed_mb"] <= every_row + 1e-9
    # The tables: one decode line per row, host path, copy slots, copy form and host memory shown; the prompts in
    # their own table.
    text = capsys.readouterr().out
    for path in ("none (auto, auto, auto)", "compute (auto, auto, auto)", "stream (auto, pallas, auto)",
                 "stream (auto, slices, auto)", "stream (1, pallas, auto)", "stream (1, slices, auto)"):
        assert text.count(f"| {path} |") == 2, path
    assert "| TTFT s | streamed MB |" in text and text.count("| 32 (16) |") == 5


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
    # The engine's decode steps and how many were launched before the previous one was read back (overlap).
    assert row["decode_steps"] >= 3 and 0 < row["overlapped_steps"] <= row["decode_steps"]


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


def test_tier_mode_compares_host_memories_and_profiles(tmp_path):
    """`--host-memory pinned,mapped` times both on the same weights (the rows moved between them), with the counters
    donated (`--donate-counts`: back-to-back steps feed each other's), and `--profile` / `--dump-hlo` leave a trace
    and the compiled HLO per row that `bench.profile` reads."""
    from strata_jax.bench.profile import main as profile_main

    out, prof, hlo = tmp_path / "tier.json", tmp_path / "prof", tmp_path / "hlo"
    assert main(["--mode", "tier", "--preset", "tiny", "--dtype", "float32", "--budgets", "quarter", "--slots", "1",
                 "--routing", "zipf", "--ctx", "64", "--fill", "8", "--steps", "2", "--warm-steps", "2",
                 "--host-path", "stream", "--stream-copy", "pallas", "--host-memory", "pinned,mapped",
                 "--donate-counts", "--profile", str(prof), "--dump-hlo", str(hlo), "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if "tok_s" in r]
    assert [r["host_memory"] for r in rows] == ["mapped", "pinned"]
    assert rows[0]["staged_experts"] > 0 and rows[0]["tok_s"] > 0
    assert sorted(p.name for p in hlo.iterdir()) == ["quarter_1_pallas-mapped-auto.hlo.txt",
                                                     "quarter_1_pallas-pinned-auto.hlo.txt"]
    for name in ("mapped", "pinned"):
        (trace,) = prof.glob(f"quarter_1_pallas-{name}-auto_zipf/**/perfetto_trace.json.gz")
        assert profile_main([str(trace), str(hlo / f"quarter_1_pallas-{name}-auto.hlo.txt")]) == 0
