"""The benchmark entry points run end to end on tiny shapes (no timings are asserted: benchmarks live in bench)."""

import json

from strata_jax.bench import main


def test_step_mode_runs(tmp_path):
    out = tmp_path / "step.json"
    assert main(["--mode", "step", "--preset", "tiny", "--slots", "1", "--ctx", "64", "--fill", "32", "--steps", "1",
                 "--bandwidth-gib", "0.01", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["slots"] == 1 and row["kernels"] > 0 and row["bytes_gb"] > 0 and row["device_ms"] > 0


def test_users_mode_runs(tmp_path):
    out = tmp_path / "users.json"
    assert main(["--mode", "users", "--preset", "tiny", "--dtype", "float32", "--users", "2", "--prompt-tokens", "16",
                 "--gen-tokens", "4", "--draft", "ngram", "--bandwidth-gib", "0.01", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["users"], r["speculation"]) for r in rows] == [(2, "none"), (2, "ngram")]
    assert all(r["aggregate_tok_s"] > 0 and r["ttft_p95_s"] >= r["ttft_p50_s"] for r in rows)
