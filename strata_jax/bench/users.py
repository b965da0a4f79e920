"""The seed system's scenario (`python -m strata_jax.bench --mode users`): N concurrent users each stream a coding
prompt through the engine; per-user decode tok/s, aggregate tok/s, time to first token p50/p95 and the drafter's
acceptance rate, with speculation off and on, beside the seed system's published figures (RTX 5090)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.host.pool import HostPool
from strata_jax.loaded_model import LoadedModel, load_model
from strata_jax.bench.tier import set_routing
from strata_jax.model.config import ExpertQuantization
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.bench.floors import copy_bandwidth, step_bytes
from strata_jax.bench.oracle import OracleDrafter, oracle_label, parse_oracle
from strata_jax.model.moe import add_routing_bias
from strata_jax.bench.synthetic import (PLE_ROWS_PER_HEAD, make_greedy_chain, preset_config, synthetic_model,
                                       synthetic_ple_tables)

# Strata, RTX 5090, 256K context (docs/ARCHITECTURE.md, "Background"): users -> (per-user tok/s, aggregate tok/s, TTFT).
SEED = {1: (144.0, 144.0, "< 2 s"), 4: (38.0, 125.0, "2-8 s"), 8: (19.0, 130.0, "2-8 s")}
SEED_SOURCE = "Strata on an RTX 5090, 256K context, its drafter on"

_CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
'''


def bench_model(args) -> LoadedModel:
    """The checkpoint given by --model, or a synthetic model at --preset shapes (no tokenizer). With
    --vram-budget-mib, the planner (for the largest --users count) decides the device expert pool."""
    gpu_experts = _planned_pool(args)
    if args.model_dir:
        if args.routing != "uniform":
            raise ValueError("--routing zipf needs a synthetic model (--preset)")
        repack = getattr(args, "repack", bool(args.planes))
        quant = {"quantize": "1bit", "planes": args.planes, "group": args.group} if repack else {}
        return load_model(args.model_dir, dtype=args.dtype, gpu_experts=gpu_experts, **quant, **_mesh_kwargs(args),
                          prefill_attention=getattr(args, "prefill_attention", "auto"))
    # With PLE (step and users modes: --no-ple leaves it out) the preset's layer and a host table
    # (strata_jax/bench/synthetic.py); with MTP its head, which `--draft mtp` drafts with.
    ple, with_mtp = getattr(args, "ple", False), getattr(args, "mtp", False)
    cfg = preset_config(args.preset, ple=ple, ple_rows_per_head=getattr(args, "ple_rows_per_head", PLE_ROWS_PER_HEAD))
    cfg = dataclasses.replace(cfg, prefill_attention_impl=getattr(args, "prefill_attention", "auto"))
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    host_path = getattr(args, "host_path", "compute")
    if "," in host_path:
        raise ValueError(f"--host-path {host_path}: users mode takes one (compute or stream)")
    quant = ExpertQuantization(planes=args.planes or 1, group=args.group, impl=args.impl, gpu_experts=gpu_experts,
                               host_path=host_path if gpu_experts is not None else "compute")
    pool = HostPool()
    model = synthetic_model(cfg, dtype, quant, host_pool=pool, with_mtp=with_mtp)
    if parse_oracle(getattr(args, "draft", "none")) is not None:  # every row of the run: the same model
        make_greedy_chain(model, cfg)
    if args.routing != "uniform":
        add_routing_bias(model)
    loaded = LoadedModel(Path(f"synthetic:{args.preset}"), cfg, model, dtype, synthetic_ple_tables(cfg), None,
                         host_pool=pool, **_mesh_kwargs(args))
    set_routing(loaded.state, args.routing, args.zipf_s)
    if loaded.mesh is not None:  # the routing bias just set, placed like the rest
        from strata_jax.model.expert_parallel import shard_state

        shard_state(loaded.state, loaded.mesh)
    return loaded


def _mesh_config(args):
    """--devices / --mesh (strata_jax/engine/mesh.py) as a MeshConfig, or None (one device)."""
    from strata_jax.engine.mesh import parse_mesh

    return parse_mesh(getattr(args, "devices", None), getattr(args, "mesh", None),
                      getattr(args, "expert_exchange", "gather"))


def _mesh_kwargs(args) -> dict:
    """load_model's mesh arguments for --devices / --mesh (none without them)."""
    config = _mesh_config(args)
    return {} if config is None else {"mesh": config.make(), "expert_exchange": config.exchange}


def _planned_pool(args) -> int | None:
    """Experts per MoE layer on the device: --gpu-experts, else planned under --vram-budget-mib (None: all)."""
    if args.gpu_experts is not None:
        return args.gpu_experts
    if args.vram_budget_mib is None:
        return None
    from strata_jax.model.config import load_config
    from strata_jax.engine.planner import device_memory, format_plan, make_plan

    cfg = load_config(args.model_dir) if args.model_dir else preset_config(args.preset)
    quant = ExpertQuantization(planes=args.planes or 1, group=args.group)
    engine = EngineConfig(slots=max(args.users), max_context=users_context(args),
                          cache_dtype=getattr(args, "cache_dtype", None))
    plan = make_plan(cfg, quant, engine, weights_dtype=args.dtype, vram_budget_mib=args.vram_budget_mib,
                     vram_reserve_mib=args.vram_reserve_mib, device=device_memory())
    mesh = _mesh_config(args)
    if mesh is not None and mesh.devices > 1:  # each device's budget: the pool is every device's part together
        from strata_jax.engine.planner import format_device_plan, make_device_plan

        per_device = make_device_plan(cfg, quant, engine, devices=mesh.devices, expert_shards=mesh.expert,
                                      weights_dtype=args.dtype, vram_budget_mib=args.vram_budget_mib,
                                      vram_reserve_mib=args.vram_reserve_mib, device=device_memory())
        print(format_device_plan(per_device), flush=True)
        if not per_device.fits:
            raise ValueError(per_device.plan.message)
        return per_device.gpu_experts
    print(format_plan(plan), flush=True)
    if not plan.fits:
        raise ValueError(plan.message)
    return plan.gpu_experts


def user_prompts(model: LoadedModel, users: int, tokens: int) -> list[tuple[int, ...]]:
    """Distinct coding prompts of `tokens` tokens (chat-formatted code when the model has a tokenizer)."""
    out = []
    rng = np.random.default_rng(0)
    for u in range(users):
        if model.tokenizer is not None:
            msg = f"User {u}: here is my code.\n\n{_CODE * 40}\nAdd type hints and a docstring to every function."
            ids = model.tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=True)
            ids = list(ids)[-tokens:]
        else:
            ids = [int(x) for x in rng.integers(0, model.config.vocab_size, tokens)]
        out.append(tuple(ids))
    return out


async def _one(engine: Engine, prompt, gen_tokens: int):
    started = time.perf_counter()
    stream = await engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=gen_tokens, ignore_eos=True)))
    first, count, last, ids = None, 0, None, []
    async for ev in stream:
        if ev.token_id is not None:
            count += 1
            ids.append(ev.token_id)
            first = first or time.perf_counter()
        last = ev
    end = time.perf_counter()
    return {
        "ttft": first - started,
        "decode_tok_s": (count - 1) / (end - first) if count > 1 else 0.0,
        "tokens": count,
        "drafted": last.draft_tokens,
        "accepted": last.accepted_draft_tokens,
        "token_ids": ids,
    }


def run_all_users(engine: Engine, prompts, gen_tokens: int) -> tuple[list[dict], float]:
    """Every prompt submitted at once to the started `engine`, `gen_tokens` tokens each: (per-request results
    (ttft, tokens, decode_tok_s, ...), wall seconds)."""

    async def all_users():
        return await asyncio.gather(*[_one(engine, p, gen_tokens) for p in prompts])

    started = time.perf_counter()
    results = asyncio.run(all_users())
    return results, time.perf_counter() - started


def _draft_model(directory: str, model: LoadedModel, config: EngineConfig, args):
    """The drafter for `--draft DIR`: a small checkpoint with the target's tokenizer (no PLE)."""
    from strata_jax.engine.draft_model import DraftModelDrafter

    if not Path(directory).is_dir():
        raise ValueError(f"--draft {directory}: not none/ngram/mtp and not a checkpoint directory")
    draft = load_model(directory, dtype=args.dtype)
    return DraftModelDrafter(draft, config, model.config.vocab_size)


def users_context(args) -> int:
    """The slots' context: `--ctx`, or just what the prompt and the output need."""
    needed = args.prompt_tokens + args.gen_tokens + 16
    if args.ctx is not None and args.ctx < needed:
        raise ValueError(f"--ctx {args.ctx} is smaller than --prompt-tokens + --gen-tokens + 16 = {needed}")
    return args.ctx or needed


def run_users(args) -> list[dict]:
    model = bench_model(args)
    ctx = users_context(args)
    bandwidth = copy_bandwidth(args.bandwidth_gib)
    net = nnx.merge(model.graphdef, model.state)
    rows = []
    drafts = ["none"] if args.draft == "none" else ["none", args.draft]
    records = {}  # users -> each prompt + its greedy answer from the "none" row (the oracle's record is compared)
    for draft in drafts:
        for users in args.users:
            builtin = draft in ("none", "ngram", "mtp")
            oracle_p = parse_oracle(draft)
            config = EngineConfig(slots=users, max_context=ctx, prefill_chunks=args.prefill_chunks, prefix_cache_mib=0,
                                  prefill_batch=args.prefill_batch,
                                  draft=draft if builtin else "none", draft_k=args.draft_k,
                                  adaptive_draft=getattr(args, "adaptive_draft", True),
                                  overlap_steps=not args.no_overlap,
                                  chain_windows=getattr(args, "chain_windows", True),
                                  cache_dtype=getattr(args, "cache_dtype", None),
                                  donate_counts=getattr(args, "donate_counts", True))
            if oracle_p is not None:  # benchmark only (strata_jax/bench/oracle.py); records in a first pass below
                drafter = OracleDrafter([], oracle_p, model.config.vocab_size, seed=users)
            else:
                drafter = None if builtin else _draft_model(draft, model, config, args)
            engine = Engine(model, config, drafter=drafter)
            engine.start()
            prompts = user_prompts(model, users, args.prompt_tokens)
            try:
                if oracle_p is not None:  # the answers this engine gives, drafting nothing, are what it replays
                    recorded, _ = run_all_users(engine, prompts, args.gen_tokens)
                    drafter.record([p + tuple(r["token_ids"]) for p, r in zip(prompts, recorded)])
                before = engine.stats()
                results, wall = run_all_users(engine, prompts, args.gen_tokens)
                stats = _counted_since(before, engine.stats())
                # Launching and read-back times are per step launched ahead of the host: decode steps and windows.
                stats["ahead_steps_total"] = (stats.get("overlapped_steps_total", 0)
                                              + stats.get("chained_windows_total", 0))
                if getattr(args, "profile", None):  # the same prompts again, 32 tokens each, under the profiler
                    trace_dir = os.path.join(args.profile, f"users{users}_{draft.replace(':', '')}")
                    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                        run_all_users(engine, prompts, min(32, args.gen_tokens))
            finally:
                engine.shutdown()
            if draft == "none":
                records[users] = [p + tuple(r["token_ids"]) for p, r in zip(prompts, results)]
            ttfts = sorted(r["ttft"] for r in results)
            # The floor of one decode step at this many slots, half-way through the answers.
            floor_ms = sum(step_bytes(model.config, net, users, args.prompt_tokens + args.gen_tokens // 2).values())
            floor_ms = floor_ms / bandwidth * 1e3
            drafted = sum(r["drafted"] for r in results)
            row = {
                "model": str(model.path), "users": users,
                "speculation": draft if oracle_p is None else oracle_label(oracle_p),
                "per_user_tok_s": statistics.mean(r["decode_tok_s"] for r in results),
                "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
                "ttft_p50_s": ttfts[len(ttfts) // 2],
                "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))],
                "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else None,
                "step_floor_ms": floor_ms,
                # Floor over the time each user waits per token (speculation can beat a one-token floor).
                "fraction_of_floor": floor_ms / (1e3 / statistics.mean(r["decode_tok_s"] for r in results)),
                "seed_per_user_tok_s": SEED.get(users, (None,) * 3)[0],
                "seed_aggregate_tok_s": SEED.get(users, (None,) * 3)[1],
                "seed_ttft": SEED.get(users, (None,) * 3)[2],
                "seed_source": SEED_SOURCE,  # the seed_* figures are published ones, not measured here
                "measured_on": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
                "gpu_hit_rate": stats.get("expert_gpu_hit_rate", 1.0),
                "routing": args.routing,
                "prefill_batch": args.prefill_batch,
                "prefill_calls": stats.get("prefill_calls_total"),
                "prefill_chunks": stats.get("prefill_chunks_total"),
                # Decode steps launched before the previous one was read back (the host's work hidden behind the
                # device's): near decode_steps when overlap works.
                "decode_steps": stats.get("decode_steps_total"),
                "overlapped_steps": stats.get("overlapped_steps_total"),
                # Verify windows built and launched on the device from the window before (EngineConfig.chain_windows)
                "chained_windows": stats.get("chained_windows_total"),
                # Per overlapped step, the engine thread's time launching it and waiting for the step before it:
                # a wait near 0 means the host is the bottleneck (the device idles between steps).
                "launch_ms_per_step": _per_step(stats, "decode_launch_seconds_total"),
                "read_back_ms_per_step": _per_step(stats, "decode_read_back_seconds_total"),
                # Of the launching: the hot-expert placement's rounds (counters read, experts promoted), which run
                # after a step is launched, per decode step (None without experts outside the pool).
                "placement_ms_per_step": (_per_step(stats, "expert_placement_seconds_total", "decode_steps_total")
                                          if stats.get("expert_placement_rounds_total") is not None else None),
                # Steps run in step with the host (verify windows; decode with PLE, speculation or grammar): the
                # runner call (launch, device, read back) and the engine thread's whole step (drafting, inputs,
                # acceptance and output too), ms per step; the rest of the engine loop is neither.
                "in_step_steps": stats.get("in_step_steps_total"),
                "in_step_call_ms_per_step": _per_step(stats, "in_step_call_seconds_total", "in_step_steps_total"),
                "in_step_ms_per_step": _per_step(stats, "in_step_seconds_total", "in_step_steps_total"),
                "verify_steps": stats.get("verify_steps_total"),
                "accepted_per_verify": (stats["accepted_draft_tokens_total"] / stats["verify_steps_total"]
                                        if stats.get("verify_steps_total") else None),
                "outputs": [r["token_ids"] for r in results],  # each user's tokens: runs that must agree, checked
            }
            if oracle_p is not None:  # what the replay saw: per-draft acceptance ~ P unless outputs left the record
                row.update(oracle_p=oracle_p, oracle_per_draft_acceptance=drafter.per_draft_acceptance(),
                           oracle_diverged=drafter.counts["diverged"], draft_k=args.draft_k,
                           # where replays left their record (history lengths), and whether this engine's answers
                           # were the "none" row's (separately compiled engines can round differently)
                           oracle_diverged_at=drafter.diverged_at,
                           oracle_record_is_none_rows=drafter.records == list(records.get(users, [])),
                           adaptive_draft=config.adaptive_draft)
            rows.append(row)
            print(f"users {users}, speculation {row['speculation']}: {row['per_user_tok_s']:.1f} tok/s per user, "
                  f"{row['aggregate_tok_s']:.1f} aggregate, TTFT p50 {row['ttft_p50_s']:.2f} s, "
                  f"GPU expert hit rate {row['gpu_hit_rate']:.1%}" + _host_note(row), flush=True)
    return rows


def _host_note(row: dict) -> str:
    note = ""
    if row["launch_ms_per_step"] is not None:
        note += (f"; per overlapped step or chained window {row['launch_ms_per_step']:.2f} ms launching, "
                 f"{row['read_back_ms_per_step']:.2f} ms waiting for the step before")
    if row.get("placement_ms_per_step") is not None:
        note += f" (expert placement {row['placement_ms_per_step']:.2f} ms per step)"
    if row.get("in_step_ms_per_step") is not None:
        note += (f"; {row['in_step_steps']} steps in step with the host: {row['in_step_call_ms_per_step']:.2f} ms "
                 f"in the call, {row['in_step_ms_per_step']:.2f} ms in all")
    if row.get("accepted_per_verify") is not None:
        note += (f"; {row['verify_steps']} verify steps ({row.get('chained_windows') or 0} chained), "
                 f"{row['accepted_per_verify']:.2f} drafts accepted per step")
    return note


def _counted_since(before: dict, after: dict) -> dict:
    """`after`, its counters (`*_total`) less `before`'s: the measured run's alone (the oracle's recording pass,
    run by the same engine before it, is not counted)."""
    return {k: v - before.get(k, 0) if k.endswith("_total") and k != "slots_total" else v for k, v in after.items()}


def _per_step(stats: dict, key: str, steps_key: str = "ahead_steps_total") -> float | None:
    steps = stats.get(steps_key)
    return stats[key] / steps * 1e3 if steps and key in stats else None


def figures_note(device: str) -> str:
    """Where the table's figures come from: this machine, and (in parentheses) the seed system's published card."""
    return (f"Measured on this machine ({device}). In parentheses: the seed system's published figures "
            f"({SEED_SOURCE}), not measured here; compare like with like only on comparable hardware.")


def print_users_table(rows: list[dict]) -> None:
    print("\n" + figures_note(f"{jax.devices()[0].device_kind}, {jax.default_backend()} backend"))
    print("\n| users | speculation | tok/s per user here (seed) | aggregate tok/s here (seed) "
          "| TTFT p50 / p95 s here (seed) | acceptance | step floor ms | floor / time per token "
          "| GPU expert hit rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        seed_u = "-" if r["seed_per_user_tok_s"] is None else f"{r['seed_per_user_tok_s']:.0f}"
        seed_a = "-" if r["seed_aggregate_tok_s"] is None else f"{r['seed_aggregate_tok_s']:.0f}"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        if r.get("oracle_per_draft_acceptance") is not None:  # the oracle's P, as measured
            acc += f" ({r['oracle_per_draft_acceptance']:.0%} per draft)"
        print(f"| {r['users']} | {r['speculation']} | {r['per_user_tok_s']:.1f} ({seed_u}) "
              f"| {r['aggregate_tok_s']:.1f} ({seed_a}) | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} "
              f"({r['seed_ttft'] or '-'}) | {acc} | {r['step_floor_ms']:.3f} | {r['fraction_of_floor']:.0%} "
              f"| {r['gpu_hit_rate']:.1%} |")


def users_args(p) -> None:
    """Adds the users-scenario flags to the bench's parser."""
    p.add_argument("--model-dir", default=None,
                   help="checkpoint for --mode users (default: the bundled demo model; with --preset, a synthetic one)")
    p.add_argument("--users", default="1,4,8", help="comma-separated concurrent user counts (default 1,4,8)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens per user")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per user")
    p.add_argument("--draft", default="ngram",
                   help="drafter for the speculation-on rows: none, ngram (default), mtp, a draft model's "
                        "checkpoint DIR (same tokenizer, no PLE; e.g. from `python -m strata_jax.weights.layer_draft`)"
                        ", or oracle:P (benchmark only: replays the none rows' greedy answers as drafts, each token "
                        "wrong with probability 1-P; its rows say \"oracle P=..\")")
    p.add_argument("--draft-k", type=int, default=4,
                   help="the longest draft per step (at most 16 for ngram and oracle, 8 for mtp and a draft model)")
    p.add_argument("--adaptive-draft", action=argparse.BooleanOptionalAction, default=True,
                   help="each slot's draft length follows its acceptance up to --draft-k (EngineConfig."
                        "adaptive_draft); --no-adaptive-draft: always --draft-k (default: adaptive)")
    p.add_argument("--no-overlap", action="store_true",
                   help="read every decode step's tokens back before launching the next (EngineConfig.overlap_steps "
                        "off), to measure what overlapping buys")
    p.add_argument("--chain-windows", action=argparse.BooleanOptionalAction, default=True,
                   help="with a drafter that also guesses on the device (mtp, oracle:P), launch each verify window "
                        "from the one before on the device, before reading it back (EngineConfig.chain_windows); "
                        "--no-chain-windows: every window in step with the host, to measure what chaining buys")
    p.add_argument("--prefill-chunks", default="64,256",
                   type=lambda v: tuple(int(c) for c in v.split(",")),
                   help="the engine's prefill chunk sizes (each is one compiled function; default 64,256)")
    p.add_argument("--prefill-batch", type=int, default=1,
                   help="users mode: the most prompts prefilled together in one call (EngineConfig.prefill_batch; "
                        "default 1: one prompt per call)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights' dtype (default: a checkpoint's as `serve` loads it, bfloat16 on a GPU and float32 "
                        "on a CPU; synthetic presets bfloat16)")
    p.add_argument("--vram-budget-mib", type=int, default=None,
                   help="users mode: plan the device expert pool for a card of this size (the other experts run "
                   "on the host); default: every expert on the device")
    p.add_argument("--vram-reserve-mib", type=int, default=1536, help="the planner's reserve (default 1536)")
    p.add_argument("--gpu-experts", type=int, default=None,
                   help="users mode: experts per MoE layer on the device, overriding the planner (experiments; "
                   "default: the planner's, or every expert without --vram-budget-mib)")
    p.add_argument("--routing", default="uniform",
                   help="synthetic routing: uniform or zipf (users mode); tier mode takes a list, e.g. uniform,zipf")
    p.add_argument("--zipf-s", type=float, default=0.6,
                   help="Zipf exponent of --routing zipf (0.6: the top quarter of 512 experts get ~78%% of pairs)")
