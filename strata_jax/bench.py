"""`python -m strata_jax.bench`: measurements of the engine against the floors of the device.

Mode `users` (default): the seed system's scenario — N concurrent users streaming a coding prompt, speculation off
and on, beside the seed system's published figures (strata_jax/bench_users.py). `--model-dir DIR` benchmarks a
checkpoint; without it, a synthetic model at `--preset` shapes.

Mode `quant`: for a checkpoint with reference outputs (tests/fixtures/ckpt/*), how 1-4 expert bit-planes change the
logits and the greedy continuation. Mode `load`: time to quantize a HF checkpoint while loading vs restoring the
directory `quantize` wrote (on a synthetic HF checkpoint written to a temporary directory).
Mode `step`: the engine's decode step (one token for every slot) on a synthetic model at
real shapes, for several slot counts. For each it reports the step time (device-only, and with the engine loop's
host round trip), the bytes the step must read and their time at the copy bandwidth measured in the same run,
the kernels the compiled step launches (from its HLO) times ~5 us each, and the fraction of the floor reached.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.bench_users import print_users_table, run_users, users_args
from strata_jax.config import ExpertQuantization
from strata_jax.floors import LAUNCH_US, copy_bandwidth, count_kernels, step_bytes
from strata_jax.engine.steps import _decode
from strata_jax.model.cache import init_cache
from strata_jax.synthetic import PRESETS, preset_config, synthetic_model



def _random_cache(cfg, slots, ctx, fill, dtype):
    cache = init_cache(cfg, slots, ctx, dtype)
    key = jax.random.key(7)
    leaves, tree = jax.tree_util.tree_flatten(cache)
    leaves = [
        (jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32) * 0.1).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for i, x in enumerate(leaves)
    ]
    cache = jax.tree_util.tree_unflatten(tree, leaves)
    return cache.replace(lengths=jnp.full((slots,), fill, jnp.int32))


def run_step_bench(args) -> list[dict]:
    cfg = preset_config(args.preset)
    quant = ExpertQuantization(planes=args.planes, group=args.group, impl=args.impl)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    bw = copy_bandwidth(args.bandwidth_gib)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s", flush=True)
    t = time.monotonic()
    model = synthetic_model(cfg, jnp.bfloat16, quant)
    graphdef, state = nnx.split(model)
    jax.block_until_ready(state)
    print(f"synthetic {args.preset}: {sum(x.nbytes for x in jax.tree_util.tree_leaves(state)) / 2**30:.1f} GiB "
          f"on device in {time.monotonic() - t:.0f}s", flush=True)
    decode = jax.jit(functools.partial(_decode, 0, graphdef), donate_argnums=(1,))

    def inputs(s):
        rng = np.random.default_rng(s)
        z = jnp.zeros(s)
        return (
            jnp.asarray(rng.integers(0, cfg.vocab_size, s), jnp.int32), jnp.ones(s, bool), (),
            z, z.astype(jnp.int32), z + 1, z.astype(jnp.uint32),
        )

    def compile_one(s):
        cache = jax.eval_shape(lambda: _random_cache(cfg, s, args.ctx, args.fill, jnp.bfloat16))
        t0 = time.monotonic()
        compiled = decode.lower(state, cache, *inputs(s)).compile()
        return s, compiled, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(len(args.slots)) as pool:
        compiled = {s: (c, dt) for s, c, dt in pool.map(compile_one, args.slots)}
    rows = []
    for s in args.slots:
        fn, compile_s = compiled[s]
        kernels = count_kernels(fn.as_text())
        cache = _random_cache(cfg, s, args.ctx, args.fill, jnp.bfloat16)
        ins = inputs(s)
        for _ in range(3):
            out, _, cache = fn(state, cache, *ins)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            out, _, cache = fn(state, cache, *ins)
        jax.block_until_ready(cache)
        device_ms = (time.perf_counter() - t0) / args.steps * 1e3
        loop = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out, _, cache = fn(state, cache, *ins)
            np.asarray(out)  # the engine needs the tokens on the host every step
            loop.append(time.perf_counter() - t0)
        loop_ms = statistics.median(loop) * 1e3
        parts = step_bytes(cfg, model, s, args.fill)
        total = sum(parts.values())
        mem_ms = total / bw * 1e3
        launch_ms = kernels * LAUNCH_US / 1e3
        floor_ms = max(mem_ms, launch_ms)
        rows.append({
            "slots": s, "device_ms": device_ms, "loop_ms": loop_ms, "tok_s": s / loop_ms * 1e3,
            "bytes_gb": total / 1e9, "bytes": parts, "mem_floor_ms": mem_ms, "kernels": kernels,
            "launch_floor_ms": launch_ms, "floor_ms": floor_ms, "fraction_of_floor": floor_ms / device_ms,
            "compile_s": compile_s,
        })
        print(f"slots {s}: {device_ms:.2f} ms/step device, {loop_ms:.2f} ms with host sync", flush=True)
        del cache
    return [{"bandwidth_tb_s": bw / 1e12, **r} for r in rows]


def run_quant_effect(args) -> list[dict]:
    """Logit error, top-1 agreement and greedy agreement per plane count against the checkpoint's reference."""
    from pathlib import Path

    from strata_jax.api import load_model

    ref = dict(np.load(Path(args.model) / "reference.npz"))
    rows = []
    for planes in (0, 1, 2, 3, 4):
        quant = {} if planes == 0 else {"quantize": "1bit", "planes": planes, "group": args.group}
        m = load_model(args.model, **quant)
        logits = m.logits(ref["input_ids"])
        greedy = m.generate([int(t) for t in ref["prompt"][0]], 16, stop_at_eos=False)
        want = [int(t) for t in ref["greedy"]]
        match = next((i for i, (a, b) in enumerate(zip(greedy, want)) if a != b), len(want))
        rows.append({
            "planes": planes or "dense",
            "logit_rel_err": float(np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()),
            "top1_agree": float(np.mean(logits.argmax(-1) == ref["logits"].argmax(-1))),
            "greedy_prefix_match": match,
        })
        print(rows[-1], flush=True)
    return rows


def run_load_times(args) -> list[dict]:
    """Seconds to load with quantize-on-load vs to restore a converted directory, on a synthetic checkpoint."""
    import tempfile
    from pathlib import Path

    from safetensors.numpy import save_file

    from strata_jax.api import load_model
    from strata_jax.weights.convert import convert_checkpoint

    raw = {**PRESETS["tiny"], "hidden_size": 512, "num_hidden_layers": 8, "num_experts": 128,
           "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}
    cfg = preset_config("tiny").__class__.from_hf_dict(raw)
    model = synthetic_model(cfg, jnp.float32)
    tensors = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            name = ".".join(str(p) for p in path)
            tensors[name] = np.asarray(node[...], np.float32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "hf", Path(tmp) / "q"
        src.mkdir()
        save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
        (src / "config.json").write_text(json.dumps(raw))
        size = (src / "model.safetensors").stat().st_size
        t = time.perf_counter()
        load_model(src, dtype="bfloat16", quantize="1bit", planes=args.planes, group=args.group)
        on_load = time.perf_counter() - t
        t = time.perf_counter()
        convert_checkpoint(src, out, planes=args.planes, group=args.group)
        convert = time.perf_counter() - t
        t = time.perf_counter()
        load_model(out, dtype="bfloat16")
        restore = time.perf_counter() - t
        rows.append({"checkpoint_mb": size / 1e6, "planes": args.planes, "quantize_on_load_s": on_load,
                     "convert_s": convert, "restore_converted_s": restore})
    print(rows[-1], flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| slots | step ms (device) | step ms (+host sync) | tok/s | GB read | mem floor ms | kernels "
          "| launch floor ms | floor / time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['slots']} | {r['device_ms']:.2f} | {r['loop_ms']:.2f} | {r['tok_s']:.0f} | {r['bytes_gb']:.2f} "
              f"| {r['mem_floor_ms']:.2f} | {r['kernels']} | {r['launch_floor_ms']:.2f} "
              f"| {r['fraction_of_floor']:.0%} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["users", "step", "quant", "load"], default="users",
                   help="what to measure (default: users, the seed system's scenario)")
    p.add_argument("--model", default="tests/fixtures/ckpt/qwen4_exp_causal", help="checkpoint for --mode quant")
    p.add_argument("--preset", choices=sorted(PRESETS), default="flash-next-125b",
                   help="synthetic model shapes (default flash-next-125b)")
    p.add_argument("--slots", default="1,4,8,16,32", help="comma-separated slot counts")
    p.add_argument("--ctx", type=int, default=4096, help="context per slot (KV cache length)")
    p.add_argument("--fill", type=int, default=2048, help="tokens already in every slot's cache")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--planes", type=int, default=1, help="expert bit-planes")
    p.add_argument("--group", type=int, default=128, help="inputs per expert scale")
    p.add_argument("--impl", default="auto", help="expert kernel: auto | pallas | xla | reference")
    p.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the bandwidth probe")
    p.add_argument("--json", help="write the rows as JSON here")
    users_args(p)
    args = p.parse_args(argv)
    args.slots = [int(s) for s in args.slots.split(",")]
    args.users = [int(u) for u in args.users.split(",")]
    if args.mode == "users":
        rows = run_users(args)
        print_users_table(rows)
    elif args.mode == "quant":
        rows = run_quant_effect(args)
    elif args.mode == "load":
        rows = run_load_times(args)
    else:
        rows = run_step_bench(args)
        print_table(rows)
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "argv": sys.argv, "device": jax.devices()[0].device_kind}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
