"""`bench --mode peer` (strata_jax/bench/peer.py): llama.cpp's benchmarks run from a folder given by path, their
JSON lines read into rows, ours beside them. Stand-in programs print what llama.cpp's print (the formats of its
llama-bench `-o jsonl` and llama-batched-bench `--output-format jsonl` printers); with STRATA_LLAMA_CPP_BIN set to a
real build, the slow test runs llama.cpp itself on a tiny GGUF of ours."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from strata_jax.bench.main import main
from strata_jax.bench.peer import (BATCHED_BENCH, LLAMA_BENCH, find_binaries, ours_beside, parse_batched_bench,
                                   parse_llama_bench, run_llama_cpp)

BENCH_LINES = [  # llama-bench -o jsonl: one object per test, fields in its order, then the samples
    {"build_commit": "abc1234", "build_number": 1, "model_type": "qwen4exp ?B Q1_0", "backends": "CUDA",
     "n_gpu_layers": 99, "flash_attn": 1, "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ns": 1315000000,
     "stddev_ns": 36000000, "avg_ts": 97.30, "stddev_ts": 2.67, "samples_ns": [1, 2, 3], "samples_ts": [1, 2, 3]},
    {"build_commit": "abc1234", "build_number": 1, "model_type": "qwen4exp ?B Q1_0", "backends": "CUDA",
     "n_gpu_layers": 99, "flash_attn": 1, "n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ns": 1315000000,
     "stddev_ns": 26000000, "avg_ts": 97.31, "stddev_ts": 1.95, "samples_ns": [1, 2, 3], "samples_ts": [1, 2, 3]},
]
BATCHED_LINES = [  # llama-batched-bench --output-format jsonl: one object per parallel count
    {"n_kv_max": 5376, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99,
     "n_threads": 16, "n_threads_batch": 16, "pp": 512, "tg": 128, "pl": 1, "n_kv": 640, "t_pp": 0.267,
     "speed_pp": 1916.0, "t_tg": 1.335, "speed_tg": 95.89, "t": 1.602, "speed": 399.5},
    {"n_kv_max": 5376, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99,
     "n_threads": 16, "n_threads_batch": 16, "pp": 512, "tg": 128, "pl": 8, "n_kv": 5120, "t_pp": 1.732,
     "speed_pp": 2365.0, "t_tg": 2.686, "speed_tg": 381.22, "t": 4.418, "speed": 1158.8},
]


def _program(folder: Path, name: str, lines: list[dict], exit_code: int = 0) -> None:
    """A stand-in for one llama.cpp program: logs on stderr, its JSON lines (and log noise) on stdout, argv kept."""
    body = "\n".join(json.dumps(line) for line in lines)
    path = folder / name
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(folder / (name + '.argv'))!r}, 'w').write('\\n'.join(sys.argv[1:]))\n"
        "print('llama_model_loader: loaded meta data', file=sys.stderr)\n"
        "print('main: n_kv_max = 5376')\n"
        f"print({body!r})\n"
        f"sys.exit({exit_code})\n")
    path.chmod(0o755)


def _args(tmp_path: Path, **kw) -> SimpleNamespace:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    base = dict(peer_bin=str(tmp_path), peer_gguf=str(gguf), preset="flash-next-125b", prompt_tokens=512,
                gen_tokens=128, users=[1, 8], peer_reps=3, peer_timeout=60.0, peer_logs=str(tmp_path / "logs"))
    return SimpleNamespace(**{**base, **kw})


def test_the_rows_are_llama_cpps_numbers_at_our_shapes(tmp_path):
    _program(tmp_path, LLAMA_BENCH, BENCH_LINES)
    _program(tmp_path, BATCHED_BENCH, BATCHED_LINES)
    rows = run_llama_cpp(_args(tmp_path))
    assert [(r["test"], r["streams"], r["tok_s_per_stream"]) for r in rows] == [
        ("tg128", 1, 97.30), ("tg128 @ d512", 1, 97.31), ("1 x pp512+tg128", 1, 95.89),
        ("8 x pp512+tg128", 8, pytest.approx(381.22 / 8))]
    assert rows[1]["tok_s_stdev"] == 1.95 and rows[3]["aggregate_tok_s"] == 381.22
    assert rows[3]["prompt_tok_s"] == 2365.0
    # The shapes asked for: every layer on the GPU, flash attention, depth 0 and the prompt, each --users count.
    single = (tmp_path / f"{LLAMA_BENCH}.argv").read_text().split("\n")
    batched = (tmp_path / f"{BATCHED_BENCH}.argv").read_text().split("\n")
    for argv in (single, batched):
        assert argv[argv.index("-m") + 1] == str(tmp_path / "m.gguf")
        assert argv[argv.index("-ngl") + 1] == "99" and argv[argv.index("-fa") + 1] == "on"
    assert single[single.index("-d") + 1] == "0,512" and single[single.index("-n") + 1] == "128"
    assert single[single.index("-o") + 1] == "jsonl" and single[single.index("-r") + 1] == "3"
    assert batched[batched.index("-npl") + 1] == "1,8" and batched[batched.index("-npp") + 1] == "512"
    assert int(batched[batched.index("-c") + 1]) >= 8 * (512 + 128)
    assert (tmp_path / "logs" / "llama-bench.log").read_text().startswith("llama_model_loader")


def test_parsers_skip_everything_but_results():
    noise = "build: 1 (abc)\n{not json}\n{\"n_gen\": 0, \"n_prompt\": 0, \"avg_ts\": 1.0}\n"
    assert parse_llama_bench(noise + json.dumps(BENCH_LINES[0])) == parse_llama_bench(json.dumps(BENCH_LINES[0]))
    assert parse_llama_bench(noise) == [] and parse_batched_bench(noise) == []
    # A prompt-only test (pp20000) is a prompt-rate row, not a decode row.
    (pp,) = parse_llama_bench('{"n_prompt": 20000, "n_gen": 0, "n_depth": 0, "avg_ts": 2101.0, "stddev_ts": 0}')
    assert (pp["test"], pp["prompt_tok_s"], pp["tok_s_per_stream"]) == ("pp20000", 2101.0, None)


def test_prefill_lengths_run_as_one_prompt_each(tmp_path):
    _program(tmp_path, LLAMA_BENCH, [*BENCH_LINES, {"n_prompt": 20000, "n_gen": 0, "n_depth": 0, "avg_ts": 2101.0,
                                                    "stddev_ts": 0.0}])
    _program(tmp_path, BATCHED_BENCH, BATCHED_LINES)
    rows = run_llama_cpp(_args(tmp_path, peer_prefill=[20000]))
    argv = (tmp_path / f"{LLAMA_BENCH}.argv").read_text().split("\n")  # the last llama-bench call: the prompt
    assert argv[argv.index("-p") + 1] == "20000" and argv[argv.index("-n") + 1] == "0"
    assert [r["test"] for r in rows if r["tok_s_per_stream"] is None] == ["pp20000"] * 2  # the stand-in prints it
    assert ours_beside(rows, [{"users": 1, "per_user_tok_s": 100.0, "aggregate_tok_s": 90.0}])[0][
        "compared_with"] == "tg128 @ d512"


def test_ours_is_compared_with_the_same_streams():
    peer = parse_llama_bench("\n".join(map(json.dumps, BENCH_LINES))) + parse_batched_bench(
        "\n".join(map(json.dumps, BATCHED_LINES)))
    ours = ours_beside(peer, [{"users": 1, "per_user_tok_s": 145.95, "aggregate_tok_s": 120.0},
                              {"users": 8, "per_user_tok_s": 76.1, "aggregate_tok_s": 320.6},
                              {"users": 4, "per_user_tok_s": 90.0, "aggregate_tok_s": 300.0}])
    # One stream against the decode after the prompt's context (tg128 @ d512), eight against S_TG / 8.
    assert ours[0]["compared_with"] == "tg128 @ d512" and ours[0]["vs_llama_cpp"] == pytest.approx(145.95 / 97.31)
    assert ours[1]["compared_with"] == "8 x pp512+tg128"
    assert ours[1]["vs_llama_cpp"] == pytest.approx(76.1 / (381.22 / 8))
    assert "vs_llama_cpp" not in ours[2]  # llama.cpp did not run 4 streams


def test_missing_or_failing_programs_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="no executable llama-bench or llama-batched-bench"):
        find_binaries(tmp_path)
    with pytest.raises(SystemExit):
        main(["--mode", "peer"])
    assert "--mode peer needs --peer-bin DIR" in capsys.readouterr().err
    _program(tmp_path, LLAMA_BENCH, [], exit_code=1)
    _program(tmp_path, BATCHED_BENCH, BATCHED_LINES)
    with pytest.raises(RuntimeError, match=r"llama-bench failed \(exit 1.*\n.*llama_model_loader"):
        run_llama_cpp(_args(tmp_path))
    _program(tmp_path, LLAMA_BENCH, [])
    with pytest.raises(RuntimeError, match="printed no results"):
        run_llama_cpp(_args(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        run_llama_cpp(_args(tmp_path, peer_gguf=str(tmp_path / "absent.gguf")))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STRATA_LLAMA_CPP_BIN"),
                    reason="set STRATA_LLAMA_CPP_BIN to a folder with llama.cpp's llama-bench and llama-batched-bench")
def test_real_llama_cpp_on_a_tiny_gguf_of_ours(tmp_path):
    """llama.cpp loads the random-weight GGUF we write (tiny preset) and its output parses into rows."""
    args = SimpleNamespace(peer_bin=os.environ["STRATA_LLAMA_CPP_BIN"], peer_gguf=None, preset="tiny",
                           prompt_tokens=32, gen_tokens=8, users=[1, 2], peer_reps=1, peer_timeout=600.0,
                           peer_logs=str(tmp_path), peer_prefill=[48])
    rows = run_llama_cpp(args)
    assert [(r["test"], r["streams"]) for r in rows] == [("tg8", 1), ("tg8 @ d32", 1), ("1 x pp32+tg8", 1),
                                                         ("2 x pp32+tg8", 2), ("pp48", 1)]
    assert all(r["tok_s_per_stream"] > 0 for r in rows[:4]) and rows[4]["prompt_tok_s"] > 0


def test_the_mode_from_the_command_line(tmp_path, monkeypatch, capsys):
    """`bench --mode peer` end to end with the stand-ins: JSON rows, the table, and JAX told not to preallocate the
    GPU that llama.cpp runs on."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    _program(tmp_path, LLAMA_BENCH, BENCH_LINES)
    _program(tmp_path, BATCHED_BENCH, BATCHED_LINES)
    args = _args(tmp_path)
    out = tmp_path / "peer.json"
    assert main(["--mode", "peer", "--peer-bin", str(tmp_path), "--peer-gguf", args.peer_gguf, "--users", "1,8",
                 "--json", str(out)]) == 0
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    rows = json.loads(out.read_text())["rows"]
    assert [r["test"] for r in rows] == ["tg128", "tg128 @ d512", "1 x pp512+tg128", "8 x pp512+tg128"]
    assert "| llama.cpp | 8 x pp512+tg128 | 8 | 47.7 | 381.2 | - |" in capsys.readouterr().out
