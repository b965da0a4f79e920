"""The benchmark command line (`python -m strata_jax.bench`): measurements of the engine against the floors of
the device.

Mode `users` (default): the seed system's scenario — N concurrent users streaming a coding prompt, speculation off
and on, beside the seed system's published figures (strata_jax/bench/users.py). By default on the bundled demo model;
`--model-dir DIR` benchmarks another checkpoint, `--preset NAME` a synthetic model at real shapes (e.g.
flash-next-125b, built on the device: no checkpoint needed).

Mode `quant`: for a checkpoint with reference outputs (tests/fixtures/ckpt/*), how 1-4 expert bit-planes change the
logits and the greedy continuation. Mode `load`: time to quantize a HF checkpoint while loading vs restoring the
directory `quantize` wrote (on a synthetic HF checkpoint written to a temporary directory).
Mode `tier`: decode tok/s and the GPU expert pool's hit rate under VRAM budgets that keep all, half or a quarter of
the experts on the device (the rest computed on the host), uniform vs Zipf routing (strata_jax/bench/tier.py).
Mode `host`: one MoE layer's host expert work alone, per host kernel (`--host-kernel xla,numpy`), for the
(tokens, host pairs) of `--host-pairs`; no device involved. Mode `roundtrip`: a host callback's cost per layer
inside a jitted program, and whether splitting it around the device work pays (strata_jax/bench/host.py).
Mode `deltanet`: one Gated DeltaNet layer's recurrence (decode and verify token counts) per implementation, against
the state's read + write at the measured bandwidth (strata_jax/bench/deltanet.py).
Mode `hyper`: one hyper-connection call (mix, inject weights, folded injection) per implementation, the jnp form
against the prefolded XLA form and the Pallas kernels of pallas_kernels.hyper_mix (strata_jax/bench/hyper.py).
Mode `attention`: one decode-attention call per implementation, the jnp form against the Pallas kernel of
pallas_kernels.decode_attention, beside the filled KV bytes at the measured bandwidth (strata_jax/bench/attention.py).
Mode `step`: the engine's decode step (one token for every slot) on a synthetic model at
real shapes, for several slot counts. For each it reports the step time (device-only, and with the engine loop's
host round trip), the bytes the step must read and their time at the copy bandwidth measured in the same run,
the kernels the compiled step launches (from its HLO) times ~5 us each, and the fraction of the floor reached.
Mode `prefill`: time to first token and prompt tok/s by prompt length (`--prompt-lengths`) on one slot of `--ctx`,
against the compute floor (matmul FLOPs over the bf16 rate measured in the same run; strata_jax/bench/prefill.py).
Mode `agents`: N concurrent coding-agent sessions shaped like Claude Code's (a shared ~20-27K-token first turn,
then turns appending tool results): TTFT by turn kind, decode while others prefill, aggregate tok/s, prefix-cache
hits and snapshot costs (strata_jax/bench/agents.py).
Mode `fuzz`: seeded hostile bodies, bad credentials and a disconnect soak against a real `serve` process (the demo
model unless `--model-dir`): status classes, 5xx, engine errors leaked to a stream alongside, leaked slots
(strata_jax/bench/fuzz.py).
Mode `gguf`: writes a random-weight llama.cpp GGUF at --preset shapes (Q1_0 experts, BF16 dense), times
`load_model` of it and of the same model converted to our format, and decode tok/s from it (strata_jax/bench/gguf.py).
Mode `peer`: llama.cpp's llama-bench and llama-batched-bench (from `--peer-bin DIR`) on a random-weight GGUF at
--preset shapes, one stream and --users streams of --prompt-tokens + --gen-tokens; `--peer-with-ours` then runs our
users mode on the same shapes beside them (strata_jax/bench/peer.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.cli_help import DefaultsFormatter
from strata_jax.engine import command_buffers
from strata_jax.engine.config import MAX_DRAFT_K, EngineConfig
from strata_jax.bench.agents import agents_args, print_agents_table, run_agents
from strata_jax.bench.attention import attention_args, print_attention_table, run_attention
from strata_jax.bench.fuzz import fuzz_args, print_fuzz_report, run_fuzz
from strata_jax.bench.gguf import gguf_args, print_gguf_table, run_gguf
from strata_jax.bench.peer import find_binaries, peer_args, print_peer_table, run_peer
from strata_jax.bench.prefill import prefill_args, print_prefill_table, run_prefill
from strata_jax.bench.deltanet import deltanet_args, print_deltanet_table, run_deltanet
from strata_jax.bench.hyper import hyper_args, print_hyper_table, run_hyper
from strata_jax.bench.host import host_args, print_host_table, print_roundtrip_table, run_host_layer, run_roundtrip
from strata_jax.engine.sampling import BRANCH_MODES, set_branch_mode
from strata_jax.bench.tier import print_tier_table, run_tier, tier_args
from strata_jax.bench.mesh import mesh_args, print_mesh_table, run_mesh_bench
from strata_jax.bench.users import bench_model, print_users_table, run_users, users_args
from strata_jax.model.config import PREFILL_ATTENTION_IMPLS
from strata_jax.demo import DEMO_MODEL
from strata_jax.model.config import ExpertQuantization
from strata_jax.engine.steps import (
    decode_step, flat_weights, jit_step, verify_step,
)
from strata_jax.bench.floors import LAUNCH_US, copy_bandwidth, kernel_ops, step_bytes
from strata_jax.model.cache import ModelCache, kv_dtype_of
from strata_jax.model.hyper import prefold_hyper_connections
from strata_jax.model.decoder import enable_fused_decode
from strata_jax.bench.synthetic import (
    PLE_ROWS_PER_HEAD, PRESETS, REAL_PARTS_BY_DEFAULT, preset_config, random_cache, synthetic_model,
    synthetic_ple_tables,
)
from strata_jax.bench.oracle import parse_oracle
from strata_jax.engine.planner import default_dtype
from strata_jax.bench.step_inputs import STEP_EXTRAS, StepInputs, mtp_bytes, mtp_draft_step


def _time_step(fn, state, cache, ins, steps: int, next_ins=None,
               chain: bool = False) -> tuple[float, float, float | None, float, object]:
    """(device ms per call over `steps` back-to-back calls, median ms per call when the host reads the first
    output every call as the engine does, ms per call back to back with each call's first output as the next one's
    first input (`chain`: decode's tokens, as the engine's overlapped steps run; else None), median ms of the host
    loop's calls until the call returned (the launch: on a GPU the CUDA graphs' submission, which a call in step
    with the host pays before the device starts), the advanced cache).
    `next_ins(first output)`: the next call's inputs, built from what the host read (PLE rows gathered for those
    tokens) inside the host loop's time."""

    def cache_of(out):
        return next(o for o in out if isinstance(o, ModelCache))

    for _ in range(3):
        out = fn(state, cache, *ins)
        cache = cache_of(out)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(state, cache, *ins)
        cache = cache_of(out)
    jax.block_until_ready(cache)
    device_ms = (time.perf_counter() - t0) / steps * 1e3
    loop, launch = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = fn(state, cache, *ins)
        launch.append(time.perf_counter() - t0)
        cache = cache_of(out)
        tokens = np.asarray(out[0])  # the engine needs the tokens on the host every step
        if next_ins is not None:
            ins = next_ins(tokens)
        loop.append(time.perf_counter() - t0)
    chained_ms = None
    if chain:  # inputs that move from call to call, as in the engine (whose CUDA graphs may then update)
        chained = ins
        t0 = time.perf_counter()
        for _ in range(steps):
            out = fn(state, cache, *chained)
            cache = cache_of(out)
            chained = (out[0], *chained[1:])
        jax.block_until_ready(cache)
        chained_ms = (time.perf_counter() - t0) / steps * 1e3
    return device_ms, statistics.median(loop) * 1e3, chained_ms, statistics.median(launch) * 1e3, cache


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k drafts yields when each draft is accepted with probability `acceptance` given the
    previous one was: the accepted prefix plus the target's own next token."""
    return sum(acceptance**i for i in range(k + 1))


def run_step_bench(args) -> list[dict]:
    cfg = preset_config(args.preset, ple=args.ple, ple_rows_per_head=args.ple_rows_per_head)
    quant = ExpertQuantization(planes=args.planes, group=args.group, impl=args.impl)
    mtp_k = args.draft_k if args.mtp else 0  # verify chains the MTP head as under --draft mtp
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    bw = copy_bandwidth(args.bandwidth_gib)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s", flush=True)
    t = time.monotonic()
    model = synthetic_model(cfg, jnp.bfloat16, quant, with_mtp=args.mtp)
    tables = synthetic_ple_tables(cfg)
    if tables:
        print(f"PLE: host table of {sum(t.rows for t in tables):,} rows x {tables[0].dim} values (bf16, "
              f"{sum(s.nbytes for t in tables for s in t.shards) / 2**30:.2f} GiB), rows gathered every step",
              flush=True)
    if args.hyper_prefold:
        print(f"hyper-connections prefolded: {prefold_hyper_connections(model)}", flush=True)
    if args.fused_decode:
        print(f"fused decode kernels (MoE router and shared expert, DeltaNet conv + rule): "
              f"{enable_fused_decode(model)} modules", flush=True)
    graphdef, state = nnx.split(model)
    jax.block_until_ready(state)
    print(f"synthetic {args.preset}: {sum(x.nbytes for x in jax.tree_util.tree_leaves(state)) / 2**30:.1f} GiB "
          f"on device in {time.monotonic() - t:.0f}s", flush=True)
    # The engine's compiled steps, with the weights passed as it passes them (a flat list of arrays) or, to measure
    # what flattening costs, as the nnx.State pytree.
    flat = args.state_args == "leaves"
    decode = jit_step(decode_step, graphdef, state, flat=flat)
    verify = jit_step(verify_step, graphdef, state, mtp_k, flat=flat)
    steps = {"decode": decode, "verify": verify}
    if mtp_k:  # the MTP drafter's own call, timed alone
        steps["mtp"] = jit_step(mtp_draft_step, graphdef, state, mtp_k, flat=flat)
    weights = flat_weights(state) if flat else state
    window = args.draft_k + 1

    def inputs(kind, s, ple_tables=(), extras="off"):
        return StepInputs(cfg, kind, s, window, jnp.bfloat16, ple_tables, extras)

    def compile_one(job):
        kind, s, kv, extras = job
        cache = jax.eval_shape(lambda: random_cache(cfg, s, args.ctx, args.fill, *_cache_dtypes(kv),
                                                    with_mtp=bool(mtp_k)))
        t0 = time.monotonic()
        fn = steps[kind]
        compiled = fn.lower(weights, cache, *inputs(kind, s, extras=extras).first()).compile()
        print(f"compiled {kind}[{s}]{_kv_label(kv)}{_extras_label(extras)} in {time.monotonic() - t0:.0f}s",
              flush=True)
        return job, compiled, time.monotonic() - t0

    # One row per (step, slots), KV cache dtype (--cache-dtype bf16,int8,fp8) and mask/log-probability inputs
    # (--step-extras; the MTP call takes none).
    jobs = [(kind, s, kv, extras) for kv in args.cache_dtypes for extras in args.step_extras
            for kind, s in [("decode", s) for s in args.slots] + [("verify", s) for s in args.verify_slots]
            + [("mtp", s) for s in (args.slots if mtp_k and extras == args.step_extras[0] else ())]]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        compiled = {job: (c, dt) for job, c, dt in pool.map(compile_one, jobs)}
    rows, decode_ms = [], {}
    for kind, s, kv, extras in jobs:
        fn, compile_s = compiled[(kind, s, kv, extras)]
        hlo = fn.as_text()
        ops = kernel_ops(hlo)
        kernels = sum(ops.values())
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"{kind}_{s}.hlo.txt"), "w") as f:
                f.write(hlo)
        cache = random_cache(cfg, s, args.ctx, args.fill, *_cache_dtypes(kv), with_mtp=bool(mtp_k))
        feed = inputs(kind, s, tables, extras)  # with PLE, the host loop gathers each step's rows from the table
        next_ins = feed.build if feed.ple is not None and kind != "mtp" else None
        device_ms, loop_ms, chained_ms, launch_ms_host, cache = _time_step(
            fn, weights, cache, feed.first(), args.steps, next_ins, chain=kind == "decode" and feed.ple is None)
        if args.profile:  # a few more steps under the profiler, as a Perfetto trace (kernel names = HLO fusions)
            ins = feed.first()
            with jax.profiler.trace(os.path.join(args.profile, f"{kind}_{s}"), create_perfetto_trace=True):
                for _ in range(2):  # bench_profile's default --steps
                    cache = next(o for o in fn(weights, cache, *ins) if isinstance(o, ModelCache))
                jax.block_until_ready(cache)
        del cache
        per_slot = window if kind == "verify" else 1
        if kind == "mtp":  # the MTP head and k reads of the LM head (its own KV aside)
            parts = {"mtp_and_lm_head": mtp_bytes(state, cfg, mtp_k)}
        else:
            parts = step_bytes(cfg, model, s, args.fill, tokens_per_slot=per_slot,
                               kv_quantized=kv_dtype_of(kv) is not None)
        total = sum(parts.values())
        mem_ms = total / bw * 1e3
        launch_ms = kernels * LAUNCH_US / 1e3
        floor_ms = max(mem_ms, launch_ms)
        row = {
            "kind": kind, "slots": s, "cache_dtype": kv or "bfloat16", "extras": extras, "tokens_per_slot": per_slot,
            "device_ms": device_ms, "loop_ms": loop_ms, "chained_ms": chained_ms, "launch_ms": launch_ms_host,
            "tok_s": s / loop_ms * 1e3, "bytes_gb": total / 1e9, "bytes": parts, "mem_floor_ms": mem_ms,
            "kernels": kernels, "kernels_by_op": ops, "launch_floor_ms": launch_ms, "floor_ms": floor_ms,
            "fraction_of_floor": floor_ms / device_ms, "compile_s": compile_s,
            "mtp_k": mtp_k if kind != "decode" else 0, "ple": bool(cfg.ple_layers),
            # host PLE work per step in the host loop (hash + gather; median ms), None without PLE
            "ple_host_ms": statistics.median(feed.host_ms) if feed.host_ms else None,
        }
        base = (s, kv, args.step_extras[0])  # ratios against the first --step-extras' decode row
        if kind == "decode":
            decode_ms.setdefault(base, loop_ms)
            if extras != args.step_extras[0] and base in decode_ms:
                row["over_first_extras"] = loop_ms / decode_ms[base]
        elif kind == "mtp" and base in decode_ms:
            row["mtp_over_decode"] = loop_ms / decode_ms[base]
        elif base in decode_ms:
            row["verify_over_decode"] = loop_ms / decode_ms[base]
            row["tok_s_at_acceptance"] = {
                str(a): s * expected_tokens(a, args.draft_k) / loop_ms * 1e3 for a in (0.5, 0.75, 0.9)
            }
        rows.append(row)
        ple_note = f", PLE gather {row['ple_host_ms']:.2f} ms on the host" if row["ple_host_ms"] is not None else ""
        chained_note = f", {chained_ms:.2f} ms chained on its own tokens" if chained_ms is not None else ""
        print(f"{kind}[{s}]{_kv_label(kv)}{_extras_label(extras)}: {device_ms:.2f} ms/call device, "
              f"{loop_ms:.2f} ms with host sync{chained_note}, {launch_ms_host:.2f} ms to launch, {kernels} kernels"
              f"{ple_note}", flush=True)
        if args.json:
            _write_json(args.json, [{"bandwidth_tb_s": bw / 1e12, **r} for r in rows])
    return [{"bandwidth_tb_s": bw / 1e12, **r} for r in rows]


def _kv_label(kv: str | None) -> str:
    return f" ({kv} KV)" if kv else ""


def _extras_label(extras: str) -> str:
    return "" if extras == "off" else f" (extras {extras})"


def _cache_dtypes(kv: str | None) -> tuple:
    """(cache dtype, KV storage dtype) of the step benchmark's bf16 model for a --cache-dtype name."""
    quantized = kv_dtype_of(kv)
    return (jnp.dtype(kv) if kv and quantized is None else jnp.bfloat16), quantized


def run_quant_effect(args) -> list[dict]:
    """Logit error, top-1 agreement and greedy agreement per plane count against the checkpoint's reference."""
    from pathlib import Path

    from strata_jax.loaded_model import load_model

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

    from strata_jax.loaded_model import load_model
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
    print("\n| step | slots | KV | ms (device) | ms (+host sync) | tok/s | GB read | mem floor ms | kernels "
          "| launch floor ms | floor / time | verify (or extras) / decode "
          "| tok/s at 50/75/90% acceptance | PLE host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['verify_over_decode']:.2f}x" if "verify_over_decode" in r else "-"
        acc = " / ".join(f"{v:.0f}" for v in r["tok_s_at_acceptance"].values()) if "tok_s_at_acceptance" in r else "-"
        name = {"decode": "decode", "mtp": f"mtp draft[{r.get('mtp_k')}]"}.get(r["kind"],
                                                                            f"verify[{r['tokens_per_slot']}]")
        if r["kind"] == "verify" and r.get("mtp_k"):
            name += f"+mtp[{r['mtp_k']}]"
        if r.get("ple"):
            name += " +PLE" if r["kind"] != "mtp" else ""
        if r.get("extras", "off") != "off":
            name += f" (extras {r['extras']})"
        ratio = f"{r['mtp_over_decode']:.2f}x" if "mtp_over_decode" in r else ratio
        ratio = f"{r['over_first_extras']:.3f}x" if "over_first_extras" in r else ratio
        kv = r.get("cache_dtype", "bfloat16")
        print(f"| {name} | {r['slots']} | {kv} | {r['device_ms']:.2f} | {r['loop_ms']:.2f} | {r['tok_s']:.0f} "
              f"| {r['bytes_gb']:.2f} | {r['mem_floor_ms']:.2f} | {r['kernels']} | {r['launch_floor_ms']:.2f} "
              f"| {r['fraction_of_floor']:.0%} | {ratio} | {acc} "
              f"| {'-' if r.get('ple_host_ms') is None else format(r['ple_host_ms'], '.2f')} |")


def _write_json(path: str, rows: list[dict]) -> None:
    meta = {"date": datetime.date.today().isoformat(), "argv": sys.argv, "device": jax.devices()[0].device_kind,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}  # with the command-buffer mode the run chose
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line: shared options first, then one group per mode."""
    p = argparse.ArgumentParser(
        prog="python -m strata_jax.bench",
        usage="%(prog)s [--mode MODE] [options of that mode] [--json FILE]",
        description="Measure the engine against the floors of the device. Each --mode has its own options below "
        "(under \"<mode> mode\"); the shared ones come first. Figures come from this machine; the users mode also "
        "shows the seed system's published RTX 5090 figures beside them, labelled as such.\n\n"
        "modes (--mode):\n"
        "  users      N concurrent users streaming a coding prompt (the seed system's scenario; default)\n"
        "  agents     N concurrent multi-turn coding-agent sessions sharing a long system prompt\n"
        "  prefill    time to first token by prompt length, against the measured matmul roof\n"
        "  step       the decode (and verify) step of a synthetic model at real shapes, against its floors\n"
        "  tier       decode with experts split between the GPU and the host under VRAM budgets\n"
        "  host       one MoE layer's host expert work alone, per host kernel (CPU)\n"
        "  roundtrip  a host callback's cost inside a jitted program\n"
        "  deltanet   one Gated DeltaNet recurrence call per implementation\n"
        "  hyper      one hyper-connection call per implementation\n"
        "  attention  one decode-attention call per implementation\n"
        "  quant      how 1-4 expert bit-planes change a checkpoint's logits\n"
        "  load       quantize-on-load against restoring a converted directory\n"
        "  fuzz       hostile bodies against a real server\n"
        "  gguf       load a llama.cpp GGUF at real shapes (and our format), decode from it\n"
        "  peer       llama.cpp's own benchmarks (a binary given by --peer-bin) at the same shapes, beside ours\n"
        "  mesh       the decode step over a device mesh (--devices) against the step without one\n\n"
        "Run `python -m strata_jax.bench --mode MODE` with that mode's options; strata_jax/bench/main.py's "
        "docstring says more about each.",
        formatter_class=DefaultsFormatter,
    )
    run = p.add_argument_group("what to run")
    run.add_argument("--mode", choices=["users", "step", "quant", "load", "tier", "host", "roundtrip", "deltanet",
                                         "hyper", "attention", "fuzz", "prefill", "agents", "mesh",
                                         "gguf", "peer"],
                     default="users", help="what to measure (the list above)")
    run.add_argument("--json", help="also write the rows as JSON to this file (default: not written)")
    model = p.add_argument_group("model and shapes (shared by several modes)")
    model.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="synthetic model shapes (step/tier/deltanet/hyper/attention modes: default "
                            "flash-next-125b; users and prefill modes: benchmark a synthetic model instead of the "
                            "bundled demo)")
    model.add_argument("--model", default="tests/fixtures/ckpt/qwen4_exp_causal", help="checkpoint for --mode quant")
    model.add_argument("--slots", default="1,4,8,16,32",
                       help="comma-separated slot counts (step, tier, deltanet, attention modes)")
    model.add_argument("--ctx", type=int, default=None,
                       help="context per slot (KV cache length; default 4096; users mode: prompt + output + 16, "
                            "while a server allocates far more, e.g. 65536: costs that grow with the allocation "
                            "show with it)")
    model.add_argument("--fill", type=int, default=2048, help="tokens already in every slot's cache")
    model.add_argument("--prefill-attention", choices=PREFILL_ATTENTION_IMPLS, default="auto",
                       help="how prompt chunks attend (users, prefill, agents modes; `serve --prefill-attention`): "
                            "auto (on a GPU the selected-keys kernel for QSA chunks, cudnn for plain ones on Hopper; "
                            "else jnp), jnp, pallas (the flash-style "
                            "kernel), cudnn, selected (QSA chunks: the kernel reading only the selected keys)")
    model.add_argument("--cache-dtype", default=None, metavar="DTYPE[,DTYPE...]",
                       help="KV cache dtype: bf16, float32, int8 or fp8 (EngineConfig.cache_dtype; int8 / fp8 "
                            "quantize K and V with a scale per position and kv head). Step mode takes a comma "
                            "list (one row per dtype); users and prefill modes one. Default: the weights' dtype")
    model.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    model.add_argument("--command-buffers", choices=command_buffers.MODES, default="auto",
                       help="how XLA keeps the steps' CUDA graphs: stable-scratch (scratch memory at a fixed "
                       "address; jax 0.11), xla (XLA's default) or auto (default: stable-scratch on a GPU unless "
                       "the run serves experts from the host: tier and host modes, --vram-budget-mib, "
                       "--gpu-experts; stable-scratch runs them, not yet measured): "
                       "strata_jax.engine.command_buffers")
    model.add_argument("--sampling-branches", choices=BRANCH_MODES, default="auto",
                       help="how the steps' sampling skips optional work: cond (lax.cond; on a GPU each copies its "
                       "predicate to the host mid-step), select (both sides computed, no host synchronisation) or "
                       "auto (default: select on a GPU for steps of up to 72 sampled rows): "
                       "strata_jax.engine.sampling.set_branch_mode")
    model.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                       help="step and users modes on a --preset: the MTP head a real checkpoint has (step mode: "
                            "verify chains it draft-k times as under --draft mtp, and its draft call is timed alone; "
                            "users mode: --draft mtp drafts with it). Default: on for flash-next-125b, off for tiny "
                            "(--no-mtp: as measured before 2026-12-02)")
    model.add_argument("--ple", action=argparse.BooleanOptionalAction, default=None,
                       help="step and users modes on a --preset: the PLE layer, its rows gathered on the host from "
                            "a synthetic n-gram table before every step. Default: on for flash-next-125b, off for "
                            "tiny (--no-ple: as measured before 2026-12-02)")
    model.add_argument("--ple-rows-per-head", type=int, default=PLE_ROWS_PER_HEAD,
                       help="rows per n-gram head of the synthetic PLE table (16 heads of 160 values in bf16: "
                            "262,144 rows per head is 1.3 GiB; the real table has 20M, 95 GiB)")
    model.add_argument("--planes", type=int, default=None,
                       help="expert bit-planes: of a synthetic --preset (default 1); with --model-dir, re-pack the "
                            "checkpoint's experts at N planes on load (default: experts as stored, as `serve` loads "
                            "them; 0 too)")
    model.add_argument("--group", type=int, default=128, help="inputs per expert scale")
    model.add_argument("--impl", default="auto", help="expert kernel: auto | pallas | xla | reference")
    model.add_argument("--bandwidth-gib", type=float, default=None,
                       help="size of the copy-bandwidth probe that floors are measured against (default: 2 GiB, or "
                            "an eighth of the free memory where it runs if that is less)")
    devices = p.add_argument_group("several devices (users and mesh modes; strata_jax/engine/mesh.py)")
    which = devices.add_mutually_exclusive_group()
    which.add_argument("--devices", type=int, default=None, metavar="N",
                       help="experts split over N devices, slots over them too (default: one device, no mesh)")
    which.add_argument("--mesh", default=None, metavar="SPEC",
                       help="users mode: a data x expert mesh, data=D,expert=E or DxE (default: one device, no mesh)")
    devices.add_argument("--expert-exchange", choices=["gather", "all_to_all"], default="gather",
                         help="users mode over a mesh: how decode and verify move tokens to the experts")
    mesh_args(p)
    step = p.add_argument_group("step mode")
    step.add_argument("--verify-slots", default="1,4,8",
                      help="slot counts for which a verify call of draft-k+1 tokens is timed too ('' = none)")
    step.add_argument("--step-extras", default="off", metavar="E[,E...]",
                      help="grammar-mask and log-probability inputs of each decode/verify row: off (none, the step "
                           "before constrained decoding), idle (present, nothing constrained: what the engine runs "
                           "for unconstrained slots), mask (slot 0 constrained), logprobs (slot 0 asks), both; a "
                           "comma list gives one row per value, ratios against the first")
    step.add_argument("--state-args", choices=["leaves", "pytree"], default="leaves",
                      help="pass the weights as a flat list of arrays (as the engine does) or as the nnx.State "
                           "pytree (to measure what flattening it on every call costs)")
    step.add_argument("--profile", metavar="DIR",
                      help="step, tier and users modes: trace a few steps of each row into DIR (users: a second "
                      "run of 32 tokens per user, refused with streamed experts on a GPU, where it crashed; Perfetto, "
                      "read with python -m strata_jax.bench.profile; default: no trace)")
    step.add_argument("--dump-hlo", metavar="DIR", help="step and tier modes: write each compiled step's HLO text into "
                      "DIR (default: not written)")
    step.add_argument("--hyper-prefold", action="store_true",
                      help="run every hyper-connection as prefold_mix (strata_jax.model.hyper), an experiment that "
                           "is off by default (no gain in the step: docs/PERF.md)")
    step.add_argument("--fused-decode", action="store_true",
                      help="calls of at most 16 tokens run the MoE router and shared expert, and each Gated "
                           "DeltaNet's conv + delta rule, as fused Pallas kernels (strata_jax.model.decoder."
                           "enable_fused_decode; off by default: 1.25x slower in the step on an H100, docs/PERF.md "
                           "\"Fused decode kernels\")")
    users_args(p.add_argument_group("users mode (--model-dir, --dtype, --prefill-chunks also prefill; --routing, "
                                    "--zipf-s, --vram-reserve-mib also tier)"))
    tier_args(p.add_argument_group("tier mode"))
    host_args(p.add_argument_group("host and roundtrip modes"))
    deltanet_args(p.add_argument_group("deltanet mode"))
    hyper_args(p.add_argument_group("hyper mode"))
    attention_args(p.add_argument_group("attention mode"))
    fuzz_args(p)  # adds its own "fuzz mode" group
    prefill_args(p)  # adds its own "prefill mode" group
    agents_args(p)  # adds its own "agents mode" group
    gguf_args(p)  # adds its own "gguf mode" group
    peer_args(p)
    return p


def bench_dtype(dtype: str | None, model_dir: str | None, backend: str) -> str:
    """The weights' dtype of a run: `dtype` when given; a checkpoint's (`model_dir`) as `serve` loads it on this
    backend (bfloat16 on a GPU, float32 on a CPU, where bfloat16 prefill measured ~2x slower); a synthetic preset's
    bfloat16."""
    if dtype is not None:
        return dtype
    return default_dtype(backend) if model_dir else "bfloat16"


def settle_planes(args: argparse.Namespace) -> None:
    """`--planes` as the modes use it: `args.repack` whether a checkpoint's experts are re-packed on load (only when
    --planes N > 0 is given: by default a checkpoint is benchmarked with its experts as `serve` loads them), and
    `args.planes` the plane count of synthetic experts (1 unless given)."""
    args.repack, args.planes = bool(args.planes), 1 if args.planes is None else args.planes


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if (args.mode == "users" and args.profile and args.host_path == "stream"
            and (args.vram_budget_mib is not None or args.gpu_experts is not None)
            and command_buffers.installed_backend() == "gpu"):
        # Both command-buffer modes ran without --profile and crashed (rc 139, no traceback) with it (H200, jax
        # 0.11.2, 2026-12-04; docs/PERF.md).
        p.error("--profile with --host-path stream and experts outside the pool: the process segfaulted under the "
                "profiler on the H200 (jax 0.11.2); run without --profile, or profile the all-resident engine")
    host_tier = args.mode in ("tier", "host") or args.vram_budget_mib is not None or args.gpu_experts is not None
    try:  # before anything starts JAX's backend
        print(command_buffers.configure(args.command_buffers, command_buffers.installed_backend(), host_tier),
              file=sys.stderr, flush=True)
    except ValueError as e:
        p.error(str(e))
    set_branch_mode(args.sampling_branches)
    if args.mode == "peer":
        try:
            find_binaries(args.peer_bin or "")
        except ValueError as e:
            p.error(str(e) if args.peer_bin else "--mode peer needs --peer-bin DIR (llama.cpp's programs)")
        # JAX starts below; left to preallocate it would hold most of the GPU while llama.cpp runs.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.mode in ("users", "prefill", "agents") and args.model_dir is None and args.preset is None:
        args.model_dir = str(DEMO_MODEL)
    args.dtype = bench_dtype(args.dtype, args.model_dir, jax.default_backend())
    settle_planes(args)
    args.preset = args.preset or "flash-next-125b"
    if args.mode not in ("step", "users") or args.model_dir:  # MTP and PLE of a synthetic preset: those modes only
        args.mtp = args.ple = False
    real = args.preset in REAL_PARTS_BY_DEFAULT  # a real checkpoint's MTP head and PLE, unless told otherwise
    args.mtp = real if args.mtp is None else args.mtp
    args.ple = real if args.ple is None else args.ple
    try:
        parse_oracle(args.draft)
        if args.mode == "step" and args.mtp and args.draft_k > MAX_DRAFT_K["mtp"]:
            raise ValueError(f"--draft-k {args.draft_k}: the MTP head chains at most {MAX_DRAFT_K['mtp']} "
                             "drafts (pass --no-mtp to time longer verify windows)")
    except ValueError as e:
        p.error(str(e))
    if args.mode not in ("users", "prefill", "agents") and args.ctx is None:
        args.ctx = 4096
    args.slots = [int(s) for s in args.slots.split(",")]
    args.verify_slots = [int(s) for s in args.verify_slots.split(",") if s]
    try:
        args.cache_dtypes = [EngineConfig(cache_dtype=d).cache_dtype if d else None
                             for d in (args.cache_dtype or "").split(",")]
    except ValueError as e:
        p.error(f"--cache-dtype: {e}")
    if len(args.cache_dtypes) > 1 and args.mode != "step":
        p.error("--cache-dtype takes a list in step mode only")
    args.cache_dtype = args.cache_dtypes[0]
    args.step_extras = [e for e in args.step_extras.split(",") if e]
    if not args.step_extras or set(args.step_extras) - set(STEP_EXTRAS):
        p.error(f"--step-extras: a comma list of {', '.join(STEP_EXTRAS)}")
    args.users = [int(u) for u in args.users.split(",")]
    if args.mode == "prefill":  # TTFT by prompt length against the compute floor (strata_jax/bench/prefill.py)
        args.users, args.prompt_tokens, args.gen_tokens = [1], max(args.prompt_lengths), 1
        rows = run_prefill(args, bench_model(args))
        print_prefill_table(rows)
    elif args.mode == "gguf":  # a llama.cpp GGUF at real shapes: write, load, convert, decode (bench/gguf.py)
        rows = run_gguf(args)
        print_gguf_table(rows)
    elif args.mode == "peer":  # llama.cpp's benchmarks at the same shapes, then ours (strata_jax/bench/peer.py)
        rows = run_peer(args)
        print_peer_table(rows)
    elif args.mode == "agents":  # multi-turn agent sessions sharing a prefix (strata_jax/bench/agents.py)
        on_row = (lambda done: _write_json(args.json, done)) if args.json else None
        rows = run_agents(args, bench_model(args), on_row)
        print_agents_table(rows)
    elif args.mode == "fuzz":  # hostile bodies against a real server (strata_jax/bench/fuzz.py)
        report = run_fuzz(args)
        print_fuzz_report(report)
        rows = [report]
    elif args.mode == "users":
        rows = run_users(args)
        print_users_table(rows)
    elif args.mode == "quant":
        rows = run_quant_effect(args)
    elif args.mode == "load":
        rows = run_load_times(args)
    elif args.mode == "tier":  # the host expert tier under VRAM budgets (strata_jax/bench/tier.py)
        rows = run_tier(args)
        print_tier_table(rows)
    elif args.mode == "host":  # one layer's host experts alone, per host kernel (strata_jax/bench/host.py)
        rows = run_host_layer(args)
        print_host_table(rows)
    elif args.mode == "roundtrip":  # host callbacks inside a jitted program: serial vs split
        rows = run_roundtrip(args)
        print_roundtrip_table(rows)
    elif args.mode == "deltanet":  # the Gated DeltaNet recurrence alone, per implementation
        rows = run_deltanet(args)
        print_deltanet_table(rows)
    elif args.mode == "hyper":  # one hyper-connection call, jnp vs prefold vs the Pallas kernels
        rows = run_hyper(args)
        print_hyper_table(rows)
    elif args.mode == "attention":  # one decode-attention call, jnp vs the Pallas kernel
        rows = run_attention(args)
        print_attention_table(rows)
    elif args.mode == "mesh":  # the decode step over a device mesh against no mesh (strata_jax/bench/mesh.py)
        rows = run_mesh_bench(args)
        print_mesh_table(rows)
    else:
        rows = run_step_bench(args)
        print_table(rows)
    if args.json:
        _write_json(args.json, rows)
    return 0

