"""llama.cpp beside us at the same shapes (`python -m strata_jax.bench --mode peer --peer-bin DIR`).

llama.cpp is not part of the project: build it from its source (its CUDA backend for a GPU, e.g. `cmake -B build
-DGGML_CUDA=ON && cmake --build build --target llama-bench llama-batched-bench`) and give the folder that holds
`llama-bench` and `llama-batched-bench`. The model is a random-weight GGUF at the preset's shapes (`--peer-gguf FILE`,
or one written by `bench.gguf.write_random_gguf` into a temporary folder: 25 GB and ~40 s at Flash-Next shapes). Its
`Q1_0` experts are our one-plane expert bytes; the rest is BF16.

llama.cpp runs the shapes our users mode measures, with its own benchmarks:

* one stream decoding `--gen-tokens` after an empty context and after a `--prompt-tokens` context: `llama-bench
  -p 0 -n G -d 0,P` (tg128, tg128 @ d512 by default);
* B streams, each decoding G tokens after its own P-token prompt, for B in `--users`: `llama-batched-bench -npp P
  -ntg G -npl B`, whose S_TG is the aggregate decode rate (per stream: S_TG / B);
* with `--peer-prefill N,...`, one prompt of N tokens each: `llama-bench -p N -n 0` (pp20000: prompt tokens per
  second, what our prefill mode's TTFT gives as N / TTFT).

All with every layer on the GPU and flash attention on. With `--peer-with-ours` our users mode then runs the same
users, prompt and answer lengths (no speculation) in this process, after llama.cpp has left the GPU, and the table
shows the two side by side with their ratio. The mode starts JAX without preallocating the GPU's memory
(`XLA_PYTHON_CLIENT_PREALLOCATE=false` unless set), so that llama.cpp finds it free.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

LLAMA_BENCH, BATCHED_BENCH = "llama-bench", "llama-batched-bench"


def find_binaries(bin_dir: str | Path) -> dict[str, Path]:
    """The two llama.cpp programs in `bin_dir`; ValueError naming what is missing and how to build it."""
    folder = Path(bin_dir)
    found = {name: folder / name for name in (LLAMA_BENCH, BATCHED_BENCH)}
    missing = [name for name, path in found.items() if not (path.is_file() and os.access(path, os.X_OK))]
    if missing:
        raise ValueError(f"--peer-bin {bin_dir}: no executable {' or '.join(missing)} there (build llama.cpp's "
                         f"targets {LLAMA_BENCH} and {BATCHED_BENCH}; see strata_jax/bench/peer.py)")
    return found


def peer_commands(bins: dict[str, Path], gguf: Path, prompt: int, gen: int, users: list[int],
                  reps: int, prefill: list[int] | None = None) -> dict[str, list[str]]:
    """The command lines (JSON lines on stdout): decode at one stream, at each of `users` streams, and (with
    `prefill`) one prompt of each length."""
    streams = sorted(set(users))
    ctx = max(streams) * (prompt + gen) + 256
    cmds = {} if not prefill else {
        "prefill": [str(bins[LLAMA_BENCH]), "-m", str(gguf), "-ngl", "99", "-fa", "on",
                    "-p", ",".join(map(str, prefill)), "-n", "0", "-r", "1", "-o", "jsonl"]}
    return cmds | {
        LLAMA_BENCH: [str(bins[LLAMA_BENCH]), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-p", "0", "-n", str(gen),
                      "-d", f"0,{prompt}", "-r", str(reps), "-o", "jsonl"],
        BATCHED_BENCH: [str(bins[BATCHED_BENCH]), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-c", str(ctx),
                        "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
                        "-npl", ",".join(map(str, streams)), "--output-format", "jsonl"],
    }


def _json_lines(text: str) -> list[dict]:
    """The JSON objects among `text`'s lines (the programs print logs around them)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's `-o jsonl` results -> rows (one stream): test name as llama.cpp prints it, tok/s mean and
    standard deviation (a prompt-only test: `prompt_tok_s`, no decode rate)."""
    rows = []
    for r in _json_lines(text):
        if "avg_ts" not in r or not (r.get("n_gen") or r.get("n_prompt")):
            continue
        if not r.get("n_gen"):  # a prompt alone: prompt tokens per second
            rows.append({"system": "llama.cpp", "program": LLAMA_BENCH, "test": f"pp{r['n_prompt']}", "streams": 1,
                         "context_tokens": 0, "gen_tokens": 0, "prompt_tokens": int(r["n_prompt"]),
                         "prompt_tok_s": float(r["avg_ts"]), "tok_s_per_stream": None, "aggregate_tok_s": None})
            continue
        test = f"tg{r['n_gen']}" + (f" @ d{r['n_depth']}" if r.get("n_depth") else "")
        rows.append({"system": "llama.cpp", "program": LLAMA_BENCH, "test": test, "streams": 1,
                     "context_tokens": int(r.get("n_depth") or 0), "gen_tokens": int(r["n_gen"]),
                     "tok_s_per_stream": float(r["avg_ts"]), "tok_s_stdev": float(r.get("stddev_ts", 0.0)),
                     "aggregate_tok_s": float(r["avg_ts"]), "model_type": r.get("model_type"),
                     "backend": r.get("backends") or r.get("backend")})
    return rows


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's `--output-format jsonl` results -> rows (B streams): S_TG (aggregate decode) and per
    stream, S_PP (prompt tokens per second)."""
    rows = []
    for r in _json_lines(text):
        if "speed_tg" not in r or not r.get("pl"):
            continue
        b = int(r["pl"])
        rows.append({"system": "llama.cpp", "program": BATCHED_BENCH, "test": f"{b} x pp{r['pp']}+tg{r['tg']}",
                     "streams": b, "context_tokens": int(r["pp"]), "gen_tokens": int(r["tg"]),
                     "tok_s_per_stream": float(r["speed_tg"]) / b, "aggregate_tok_s": float(r["speed_tg"]),
                     "prompt_tok_s": float(r["speed_pp"])})
    return rows


def _run(cmd: list[str], log: Path, timeout_s: float) -> str:
    """Runs one program, its stderr into `log`; RuntimeError with the log's tail when it fails."""
    print(f"peer: {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as err:
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{Path(cmd[0]).name} ran past {timeout_s:.0f} s (log: {log})") from e
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {done.returncode}; log {log}):\n{tail}")
    print(f"peer: {Path(cmd[0]).name} done in {time.perf_counter() - started:.0f} s", flush=True)
    return done.stdout


def run_llama_cpp(args) -> list[dict]:
    """llama.cpp's rows for `args` (--peer-bin, --peer-gguf, --preset, --prompt-tokens, --gen-tokens, --users,
    --peer-reps, --peer-timeout)."""
    bins = find_binaries(args.peer_bin)
    workdir = Path(tempfile.mkdtemp(prefix="strata-peer-"))
    try:
        gguf = Path(args.peer_gguf) if args.peer_gguf else None
        if gguf is None:
            from strata_jax.bench.gguf import write_random_gguf
            from strata_jax.bench.synthetic import preset_config

            gguf = workdir / f"{args.preset}-q1_0.gguf"
            print(f"peer: writing a random-weight GGUF at {args.preset} shapes to {gguf} ...", flush=True)
            write_random_gguf(gguf, preset_config(args.preset), seed=0)
        elif not gguf.is_file():
            raise ValueError(f"--peer-gguf {gguf}: no such file")
        prefill = getattr(args, "peer_prefill", None)
        cmds = peer_commands(bins, gguf, args.prompt_tokens, args.gen_tokens, args.users, args.peer_reps, prefill)
        logs = Path(args.peer_logs) if args.peer_logs else workdir
        logs.mkdir(parents=True, exist_ok=True)
        single = parse_llama_bench(_run(cmds[LLAMA_BENCH], logs / "llama-bench.log", args.peer_timeout))
        batched = parse_batched_bench(_run(cmds[BATCHED_BENCH], logs / "llama-batched-bench.log",
                                           args.peer_timeout))
        prompts = []
        if prefill:
            prompts = parse_llama_bench(_run(cmds["prefill"], logs / "llama-bench-prefill.log", args.peer_timeout))
        if not single or not batched or (prefill and not prompts):
            raise RuntimeError(f"llama.cpp printed no results (logs in {logs})")
        return single + batched + prompts
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def ours_beside(peer_rows: list[dict], our_rows: list[dict]) -> list[dict]:
    """Our users rows (no speculation) as peer-table rows, each with its ratio to llama.cpp's row of the same
    streams: the batched row, or for one stream the decode after the prompt's context."""
    out = []
    for r in our_rows:
        users = int(r["users"])
        same = [p for p in peer_rows if p["streams"] == users and p["program"] == BATCHED_BENCH]
        if users == 1:
            same = [p for p in peer_rows if p["streams"] == 1 and p["context_tokens"] > 0] or same
        row = {"system": "strata_jax", "program": "bench --mode users", "test": f"{users} x users", "streams": users,
               "tok_s_per_stream": float(r["per_user_tok_s"]), "aggregate_tok_s": float(r["aggregate_tok_s"])}
        if same:
            row["vs_llama_cpp"] = row["tok_s_per_stream"] / same[0]["tok_s_per_stream"]
            row["compared_with"] = same[0]["test"]
        out.append(row)
    return out


def run_peer(args) -> list[dict]:
    """llama.cpp's rows, then (with --peer-with-ours) ours on the same shapes."""
    rows = run_llama_cpp(args)
    if args.peer_with_ours:
        from strata_jax.bench.users import run_users

        args.draft = "none"
        rows += ours_beside(rows, run_users(args))
    return rows


def print_peer_table(rows: list[dict]) -> None:
    print("\n| system | test | streams | tok/s per stream | aggregate tok/s | ours / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["tok_s_per_stream"] is None:
            continue
        spread = f" ± {r['tok_s_stdev']:.2f}" if r.get("tok_s_stdev") else ""
        ratio = f"{r['vs_llama_cpp']:.2f}x (vs {r['compared_with']})" if "vs_llama_cpp" in r else "-"
        print(f"| {r['system']} | {r['test']} | {r['streams']} | {r['tok_s_per_stream']:.1f}{spread} "
              f"| {r['aggregate_tok_s']:.1f} | {ratio} |")
    prompts = [r for r in rows if r["tok_s_per_stream"] is None]
    if prompts:
        print("\n| system | test | prompt tok/s |\n|---|---|---|")
        for r in prompts:
            print(f"| {r['system']} | {r['test']} | {r['prompt_tok_s']:.0f} |")


def peer_args(p) -> None:
    """The peer mode's flags (it also reads --preset, --users, --prompt-tokens, --gen-tokens)."""
    g = p.add_argument_group("peer mode")
    g.add_argument("--peer-bin", metavar="DIR", help="peer mode: the folder holding llama.cpp's llama-bench and "
                   "llama-batched-bench (default: none; peer mode then stops, asking for it)")
    g.add_argument("--peer-gguf", metavar="FILE", help="peer mode: the GGUF to run (default: a random-weight one "
                   "at --preset shapes, written to a temporary folder and removed)")
    g.add_argument("--peer-reps", type=int, default=3, help="peer mode: llama-bench repetitions")
    g.add_argument("--peer-timeout", type=float, default=1800.0, help="peer mode: seconds each program may run")
    g.add_argument("--peer-logs", metavar="DIR", help="peer mode: keep llama.cpp's logs here (default: removed)")
    g.add_argument("--peer-prefill", type=lambda v: [int(n) for n in v.split(",") if n], default=None,
                   metavar="N,...", help="peer mode: also one prompt of each length through llama-bench (prompt "
                   "tokens per second; e.g. 20000; default: none)")
    g.add_argument("--peer-with-ours", action="store_true",
                   help="peer mode: then run our users mode on the same shapes and compare")
