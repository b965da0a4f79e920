"""Reproduces the CPU engine hang (issue 20, item 9): many fresh engines, each given a few simultaneous greedy
requests while busy loops load every core. Prints one line per run (ok / HANG) and a summary.

    python -m tools.hang_repro --runs 12 [--eigen-single] [--serve]

--serve runs the real server (`python -m strata_jax serve`, port 0) and sends the requests over HTTP, as the
original report did; without it the engine is driven in-process. --long is the setup that reproduces it (4 of 10
runs on 2026-12-01 with other work on the 2 cores): the demo model, one slot of 65,536 tokens, 2,048-token chunks,
one 26,500-token prompt; a run counts as hung when the engine's watchdog (60 s per iteration) trips.
--sync-dispatch turns XLA:CPU's asynchronous dispatch off in the child (it did not help).

Each run is a subprocess with its own timeout, so a hung run is counted, not waited on forever.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

CHILD = r"""
import asyncio, sys, time
import strata_jax
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
model = strata_jax.load_model(sys.argv[1])
engine = Engine(model, EngineConfig(slots=4, max_context=1024, draft="none"))
engine.start()
async def one(i):
    s = await engine.submit(GenerationRequest(tuple(range(5 + i, 45 + i)), SamplingParams(max_tokens=40)))
    return [e async for e in s]
async def main():
    return await asyncio.gather(*(one(i) for i in range(int(sys.argv[2]))))
t = time.monotonic()
asyncio.run(main())
print(f"served in {time.monotonic() - t:.2f}s", flush=True)
engine.shutdown()
"""


LONG = r"""
import asyncio, sys, time
import jax
if sys.argv[1] == "sync":
    jax.config.update("jax_cpu_enable_async_dispatch", False)
import numpy as np
import strata_jax
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
engine = Engine(strata_jax.load_model(DEMO_MODEL), EngineConfig(slots=1, max_context=65536,
                prefill_chunks=(256, 2048), watchdog_s=60))
engine.start()
async def one():
    ids = tuple(int(x) for x in np.random.default_rng(int(time.time())).integers(0, 1000, 26500))
    s = await engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=1)))
    return [e async for e in s][-1]
t = time.monotonic()
last = asyncio.run(one())
if last.finish_reason != "error":
    print(f"served in {time.monotonic() - t:.2f}s", flush=True)
else:
    import os, subprocess
    # gdb sees every native thread (XLA's worker pools included); py-spy only the Python ones.
    # SIGKILL: gdb ignores SIGTERM while its target is stopped, and loading jaxlib's symbols takes minutes under load.
    gdb = ["timeout", "-s", "KILL", "300", "gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 30"]
    dump = subprocess.run(gdb, capture_output=True, text=True)
    open(f"/tmp/hang-{os.getpid()}.txt", "w").write(dump.stdout + dump.stderr)
    for waited in range(int(sys.argv[2])):  # a slow step comes back and the engine reports healthy again
        if engine.health()[0]:
            break
        time.sleep(1)
    state = "recovered" if engine.health()[0] else "stuck"
    print(f"HUNG ({state} {waited}s after the watchdog; stacks in /tmp/hang-{os.getpid()}.txt)", flush=True)
    os._exit(0)
engine.shutdown()
"""


STANDALONE = r"""
import os, subprocess, sys, threading, time
import numpy as np
import jax
import strata_jax
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.runner import ModelRunner, RunnerModel
from strata_jax.engine.steps import greedy_sampling
calls, limit, chunk = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
model = strata_jax.load_model(DEMO_MODEL)
runner = ModelRunner(RunnerModel.of(model),
                     EngineConfig(slots=1, max_context=65536, prefill_chunks=(chunk,), draft="none"))
state = {"call": -1, "since": time.monotonic()}

def watch():
    while True:
        time.sleep(1)
        if time.monotonic() - state["since"] > (limit if state["call"] > 0 else 900):  # call 0 compiles
            gdb = ["timeout", "-s", "KILL", "300", "gdb", "-p", str(os.getpid()), "-batch", "-ex",
                   "thread apply all bt 30"]
            path = f"/tmp/hang-standalone-{os.getpid()}.txt"
            try:
                dump = subprocess.run(gdb, capture_output=True, text=True)
                open(path, "w").write(dump.stdout + dump.stderr)
            except OSError as exc:  # no gdb (or no timeout) here: the hang is still reported
                path = f"no stacks: {exc}"
            print(f"HUNG in call {state['call']} ({limit:.0f}s; stacks in {path})", flush=True)
            os._exit(3)

threading.Thread(target=watch, daemon=True).start()
rng = np.random.default_rng(0)
per_prompt = 65536 // chunk - 1
times = []
for i in range(calls):
    if i % per_prompt == 0:
        runner.reset(0)
    jax.block_until_ready(runner.cache)  # every input of the next call is ready before it is launched
    tokens = rng.integers(0, 1000, (1, chunk)).astype(np.int32)
    state["call"], state["since"] = i, time.monotonic()
    t0 = time.perf_counter()
    rows, _ = model.ple_inputs(model.ple_context([]), tokens, np.array([chunk], np.int32))
    runner.prefill([0], tokens, [chunk], [-1], rows, greedy_sampling(1))
    times.append(time.perf_counter() - t0)
    if i < 2 or i % 25 == 0:
        print(f"call {i}: {times[-1]:.2f}s", flush=True)
print(f"ok: {calls} calls, median {np.median(times[1:]):.2f}s, max {max(times[1:]):.2f}s", flush=True)
"""


def _serve_once(args, env) -> str:
    """One server run: start, wait for `listening on`, send the requests at once; raises TimeoutExpired."""
    import json
    import re
    import threading
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "strata_jax", "serve", "--model", args.model, "--slots", "4",
                             "--ctx", "1024", "--port", "0", "--watchdog", "0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in proc.stdout:
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
                break
        if url is None:
            return f"server exited: rc={proc.wait()}"
        deadline = time.monotonic() + args.timeout  # from "listening on": start-up under load takes its own time
        results = []

        def ask(i):
            body = json.dumps({"model": "x", "max_tokens": 40, "temperature": 0,
                               "messages": [{"role": "user", "content": f"hello number {i}"}]}).encode()
            req = urllib.request.Request(url + "/v1/messages", body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=max(1.0, deadline - time.monotonic())) as r:
                results.append(r.status)

        t0 = time.monotonic()
        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if len(results) < args.requests:
            _dump_stacks(proc.pid)
            raise subprocess.TimeoutExpired("serve", args.timeout)
        return f"served {results} in {time.monotonic() - t0:.2f}s"
    finally:
        proc.kill()
        proc.wait()


def _dump_stacks(pid: int) -> None:
    """Prints the hung process's Python and native stacks (py-spy, when installed) for the report."""
    try:
        out = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=60)
        print(out.stdout[-6000:] or out.stderr[-2000:], flush=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"(no stack dump: {exc})", flush=True)


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds after start-up (the server listening; in-process: the whole run) before a run "
                         "counts as hung (default 60)")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy loops beside each run")
    ap.add_argument("--eigen-single", action="store_true", help="run with --xla_cpu_multi_thread_eigen=false")
    ap.add_argument("--xla-flags", default="", help="more XLA_FLAGS for the runs (A/B of XLA:CPU options)")
    ap.add_argument("--model", default="tests/fixtures/ckpt/qwen4_exp_causal")
    ap.add_argument("--serve", action="store_true", help="through the HTTP server, as first reported")
    ap.add_argument("--long", action="store_true", help="the long-prompt setup that reproduces it (see above)")
    ap.add_argument("--stuck-wait", type=int, default=120,
                    help="--long: seconds to wait after a watchdog trip for the step to come back (default 120)")
    ap.add_argument("--sync-dispatch", action="store_true", help="--long with asynchronous dispatch off")
    ap.add_argument("--standalone", type=int, default=0, metavar="CALLS",
                    help="no engine: one thread calls the compiled demo prefill (one slot of 65,536 tokens) CALLS "
                         "times, each after its inputs are ready; a call past --timeout counts as hung (gdb stacks)")
    ap.add_argument("--chunk", type=int, default=2048, help="--standalone: the prefill chunk (default 2048)")
    args = ap.parse_args()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if args.eigen_single:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    if args.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    hangs = 0
    try:
        for i in range(args.runs):
            t0 = time.monotonic()
            try:
                if args.serve:
                    print(f"run {i}: {_serve_once(args, env)} ({time.monotonic() - t0:.0f}s)", flush=True)
                    continue
                if args.standalone:
                    r = subprocess.run([sys.executable, "-c", STANDALONE, str(args.standalone), str(args.timeout),
                                        str(args.chunk)], env=env, capture_output=True, text=True,
                                       timeout=args.timeout * args.standalone + 1800)
                    hangs += "HUNG" in r.stdout
                    tail = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
                    print(f"run {i}: {tail} ({time.monotonic() - t0:.0f}s)", flush=True)
                    continue
                if args.long:
                    mode = "sync" if args.sync_dispatch else "async"
                    r = subprocess.run([sys.executable, "-c", LONG, mode, str(args.stuck_wait)], env=env,
                                       capture_output=True, text=True, timeout=args.timeout + 1800)
                    hung = "HUNG" in r.stdout
                    hangs += hung
                    tail = (r.stdout.strip().splitlines() or [r.stderr.strip()[-200:]])[-1]
                    print(f"run {i}: {tail} ({time.monotonic() - t0:.0f}s)", flush=True)
                    continue
                r = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.requests)], env=env,
                                   capture_output=True, text=True, timeout=args.timeout + 240)
                tail = (r.stdout.strip().splitlines() or [r.stderr.strip()[-200:]])[-1]
                print(f"run {i}: rc={r.returncode} {tail} ({time.monotonic() - t0:.0f}s)", flush=True)
            except subprocess.TimeoutExpired:
                hangs += 1
                print(f"run {i}: HANG (no answer in {args.timeout:.0f}s after start-up)", flush=True)
    finally:
        stop.set()
    print(f"{hangs} hung of {args.runs} (XLA_FLAGS={env.get('XLA_FLAGS', '')!r}, load={args.load}, "
          f"serve={args.serve})",
          flush=True)


if __name__ == "__main__":
    main()
