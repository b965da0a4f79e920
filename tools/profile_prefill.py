"""Profiles prefill chunks of the synthetic Flash-Next model on the GPU and prints the kernels that take the time.

    python -m tools.profile_prefill --ctx 65536 --tokens 20000 --chunk 4096 --out DIR

Builds the engine (1 slot, chunks of --chunk tokens, the prefix cache off), prefills one prompt untimed, then traces
the prefill of another (`jax.profiler`, Perfetto trace under DIR) and sums the device events of the trace by name.
It also writes the chunk's compiled HLO (DIR/prefill.hlo.txt) and, through `strata_jax.bench.profile`, sums the time
per model component (the decoder's named scopes; the QSA indexer apart) and per matrix product, and lists the host's
events (a loop XLA runs on the host, copying its predicate back every iteration, shows there as device-to-host
copies and waits); with --tokens a multiple of --chunk every traced kernel belongs to that one executable. The traced
prompt's chunks at later positions cost more than the first: compare --tokens 4096 with a longer prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import glob
import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.bench.prefill import _first_token
from strata_jax.bench.synthetic import preset_config, synthetic_model
from strata_jax.engine import Engine, EngineConfig
from strata_jax.host.pool import HostPool
from strata_jax.loaded_model import LoadedModel
from strata_jax.model import attention
from strata_jax.model.config import ExpertQuantization


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash-next-125b", help="synthetic model (tiny: a CPU check of this tool)")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens); `serve` picks 4,096 on a big GPU")
    ap.add_argument("--top", type=int, default=40, help="kernel names listed")
    ap.add_argument("--out", required=True)
    ap.add_argument("--select-blocks", type=int, default=None, metavar="N",
                    help="QSA blocks the indexer scores per loop iteration (strata_jax.model.attention."
                         "SELECT_BLOCKS, default 1,024): fewer, larger iterations are fewer host round trips of the "
                         "loop, each sorting more")
    args = ap.parse_args(argv)
    if args.select_blocks is not None:
        if args.select_blocks < 1:
            ap.error("--select-blocks must be >= 1")
        attention.SELECT_BLOCKS = args.select_blocks  # read while the engine's steps are traced, below

    cfg = preset_config(args.preset)
    pool = HostPool()
    net = synthetic_model(cfg, jnp.bfloat16, ExpertQuantization(), host_pool=pool)
    model = LoadedModel(Path("synthetic"), cfg, net, jnp.bfloat16, [], None, host_pool=pool)
    engine = Engine(model, EngineConfig(slots=1, max_context=args.ctx, prefill_chunks=(args.chunk,),
                                        prefix_cache_mib=0))
    engine.start()
    rng = np.random.default_rng(0)
    prompt = lambda: tuple(int(t) for t in rng.integers(0, cfg.vocab_size, args.tokens))  # noqa: E731
    print(f"untimed: {asyncio.run(_first_token(engine, prompt())):.2f}s", flush=True)
    with jax.profiler.trace(args.out, create_perfetto_trace=True):
        print(f"traced: {asyncio.run(_first_token(engine, prompt())):.2f}s", flush=True)
    hlo_text = engine.compiled_hlo().get(f"prefill[{args.chunk}]")
    engine.shutdown()
    if hlo_text is not None:
        Path(args.out, "prefill.hlo.txt").write_text(hlo_text)
    totals, counts = collections.Counter(), collections.Counter()
    for path in glob.glob(f"{args.out}/**/*.trace.json.gz", recursive=True):
        events = json.load(gzip.open(path)).get("traceEvents", [])
        pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
        for e in events:
            if e.get("ph") == "X" and "GPU" in pids.get(e.get("pid"), "") or "/device:" in pids.get(e.get("pid"), ""):
                if e.get("ph") == "X":
                    totals[e["name"][:90]] += e.get("dur", 0)
                    counts[e["name"][:90]] += 1
    total = sum(totals.values())
    print(f"device events: {total / 1e3:.1f} ms in {sum(counts.values())} events")
    for name, us in totals.most_common(args.top):
        print(f"{us / 1e3:9.1f} ms {counts[name]:6d}x  {name}")
    if hlo_text is not None:
        _by_component(args.out, hlo_text, args.top)


def _by_component(out: str, hlo_text: str, top: int) -> None:
    """Time per model component and per matrix product over the whole traced prompt (ms), from the trace and HLO."""
    from strata_jax.bench import profile

    for path in glob.glob(f"{out}/**/perfetto_trace.json.gz", recursive=True):
        trace = json.load(gzip.open(path))
        print("\n| component | kernels | ms |\n| --- | --- | --- |")
        for name, n, us in profile.summarize(trace, hlo_text, 1)[:top]:
            print(f"| {name} | {n} | {us / 1e3:.1f} |")
        print("\n| output shape | op | kernels | ms |\n| --- | --- | --- | --- |")
        for shape, op, n, us in profile.gemm_rows(trace, hlo_text, 1)[:top]:
            print(f"| {shape} | {op[:110]} | {n} | {us / 1e3:.1f} |")
        print("\n| host event | calls | ms |\n| --- | --- | --- |")
        for name, calls, us, _ in profile.host_rows(trace, 1)[:top]:
            print(f"| {name[:110]} | {calls:.0f} | {us / 1e3:.1f} |")
        return


if __name__ == "__main__":
    main()
