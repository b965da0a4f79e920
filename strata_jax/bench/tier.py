"""The host expert tier under a VRAM budget (`python -m strata_jax.bench --mode tier`): for each budget (all experts
on the device, half, a quarter, or a card size in MiB) the planner picks the device pool; a synthetic model at
`--preset` shapes is built with that pool (the other experts in host RAM, computed in numpy), and the decode step
is timed for each slot count with uniform routing and with Zipf-skewed routing (`RoutingBias` = log of a Zipf
distribution over a random permutation of each layer's experts), after hot-expert placement has had
`--warm-steps` steps to adapt. Reports decode tok/s and the pool's hit rate (routed pairs served by the device).

Distinct compiled shapes: one decode step per (pool size, slot count); router biases and placement only change
array values.

`--host-path stream` serves the experts outside the pool from pinned host memory inside the step instead
(strata_jax/model/expert_stream.py; the pool shrinks by the staging rows' room, `planner.stream_plan`), with
`--copy-slots` staging rows per decode round (auto: sized per call) and `--stream-copy` forms of the copy
(pallas_kernels.host_gather: slices, pallas) from `--host-memory` (pinned, mapped: every combination of the
three lists); `--compute-budgets` adds host-compute rows
at those budgets as the baseline. Rows then also report the MB copied over PCIe and the experts staged per step.
`--profile DIR` traces two more back-to-back steps per row (Perfetto, read with `python -m
strata_jax.bench.profile`: kernels in command buffers, device busy against the step's span) and `--dump-hlo DIR`
writes each compiled step's HLO. `--prefill-tokens N` also times an N-token prompt (chunks of `--prefill-chunk`,
one slot, the engine's prefill step) on every streaming or all-resident model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import math
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.loaded_model import LoadedModel
from strata_jax.model.config import ExpertQuantization
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.placement import ExpertPlacement, PlacementConfig
from strata_jax.engine.planner import MIB, MemoryPlan, device_memory, make_plan, stream_plan
from strata_jax.engine.steps import (FlatWeights, decode_step, greedy_sampling, jit_step, jit_step_donating_counts,
                                     prefill_args, prefill_step)
from strata_jax.model.cache import init_cache
from strata_jax.host.pool import HostPool, check_kernel
from strata_jax.model.expert_stream import resolve_host_memory, to_host_memory
from strata_jax.model.moe import QuantizedExperts, add_routing_bias
from strata_jax.bench.floors import count_kernels, host_launches
from strata_jax.bench.synthetic import preset_config, random_cache, synthetic_model

FRACTIONS = {"all": 1.0, "half": 0.5, "quarter": 0.25}


def zipf_bias(num_experts: int, s: float, seed: int) -> np.ndarray:
    """log p of a Zipf(s) distribution over a random permutation of the experts (float32 [E])."""
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** -s
    p /= p.sum()
    return np.log(p)[np.random.default_rng(seed).permutation(num_experts)].astype(np.float32)


def set_routing(state: nnx.State, routing: str, s: float) -> None:
    """Sets every layer's `RoutingBias` (if the model has them): zeros (uniform) or a Zipf(s) log-probability over
    its own permutation."""
    if routing not in ("uniform", "zipf"):
        raise ValueError(f"routing must be uniform or zipf, got {routing!r}")
    layer = 0
    for path, var in nnx.to_flat_state(state):
        if path[-2:] == ("gate", "bias"):
            e = var.get_value().shape[0]
            bias = np.zeros(e, np.float32) if routing == "uniform" else zipf_bias(e, s, seed=layer)
            var.set_value(jnp.asarray(bias))
            layer += 1


def budget_mib(cfg, quant, engine: EngineConfig, label: str, reserve_mib: int) -> int:
    """A budget label -> MiB: a fraction of the experts ("all", "half", "quarter") on top of the fixed parts, or
    an explicit number."""
    if label not in FRACTIONS:
        return int(label)
    base = make_plan(cfg, quant, engine, vram_budget_mib=1 << 30, vram_reserve_mib=reserve_mib, suggest=False)
    experts = math.ceil(FRACTIONS[label] * base.num_experts)
    need = base.fixed_bytes + base.reserve + experts * base.expert_bytes * base.moe_layers
    return -(-need // MIB)


def _plan(cfg, quant, engine: EngineConfig, mib: int, reserve_mib: int) -> MemoryPlan:
    return make_plan(cfg, quant, engine, vram_budget_mib=mib, vram_reserve_mib=reserve_mib, device=device_memory(),
                     suggest=False)


def _build(cfg, quant: ExpertQuantization, gpu_experts: int, dtype, host_kernel: str, host_path: str = "compute",
           copy_slots: int | None = None, prefill_copy_slots: int | None = None, stream_copy: str = "auto",
           host_memory: str = "auto"):
    q = ExpertQuantization(quant.planes, quant.group, quant.impl,
                           gpu_experts=None if gpu_experts >= cfg.num_experts else gpu_experts, host_path=host_path,
                           copy_slots=copy_slots, prefill_copy_slots=prefill_copy_slots, stream_copy=stream_copy,
                           host_memory=host_memory)
    pool = HostPool(kernel=host_kernel)
    model = synthetic_model(cfg, dtype, q, host_pool=pool)
    add_routing_bias(model)
    return LoadedModel(Path("synthetic"), cfg, model, dtype, [], None, host_pool=pool)


def run_tier(args) -> list[dict]:
    cfg = preset_config(args.preset)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    quant = ExpertQuantization(planes=args.planes, group=args.group, impl=args.impl)
    routings = args.routing.split(",")
    host_kernel = args.host_kernel.split(",")[0]
    check_kernel(host_kernel)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    # A budget is planned for the largest slot count that fits it, as `serve --slots N` would, and that pool serves
    # the smaller slot counts too (larger ones are refused rows). Models are shared by pool size.
    paths = args.host_path.split(",")
    compute_at = set(args.compute_budgets.split(",")) if args.compute_budgets else set()
    copy_forms = [(None if c == "auto" else int(c), form, memory) for c in args.copy_slots.split(",")
                  for form in args.stream_copy.split(",")
                  for memory in args.host_memory.split(",")]  # (staging rows per round, how rows cross, from where)
    jobs: dict[tuple[int, str, tuple[int | None, str, str], int | None], list[tuple[str, int, int, MemoryPlan]]] = {}
    rows = []
    for label in args.budgets.split(","):
        for top in sorted(args.slots, reverse=True):
            engine = EngineConfig(slots=top, max_context=args.ctx)
            mib = budget_mib(cfg, quant, engine, label, args.vram_reserve_mib)
            plan = _plan(cfg, quant, engine, mib, args.vram_reserve_mib)
            if not plan.fits:
                print(f"budget {label} ({mib} MiB), {top} slots: {plan.message}", flush=True)
                rows.append({"budget": label, "budget_mib": mib, "slots": top, "refused": plan.message})
                continue
            if label in FRACTIONS:  # exactly that share (MiB rounding may add a few small experts)
                plan = dataclasses.replace(plan, gpu_experts=math.ceil(FRACTIONS[label] * cfg.num_experts))
            for path in paths + (["compute"] if label in compute_at and "compute" not in paths else []):
                pool, slots_choices, chunk_slots = plan.gpu_experts, [(None, "auto", "auto")], None
                if path == "stream" and plan.gpu_experts < cfg.num_experts:
                    slots_choices = copy_forms
                    if label not in FRACTIONS:  # a card size: the staging's room comes out of the pool
                        streaming = stream_plan(plan, engine, "gpu", "stream")
                        print(f"budget {label}: {streaming.reason}", flush=True)
                        if streaming.host_path != "stream":
                            continue
                        pool, chunk_slots = streaming.gpu_experts, streaming.prefill_copy_slots
                elif path == "stream":
                    path = "none"  # every expert resident
                for c in slots_choices:
                    for s in sorted(x for x in args.slots if x <= top):
                        jobs.setdefault((pool, path, c, chunk_slots), []).append((label, mib, s, dataclasses.replace(
                            plan, gpu_experts=pool)))
            break
    model, built = None, None
    for (gpu_experts, path, slots_choice, chunk_slots), entries in sorted(
            jobs.items(), key=lambda j: (-j[0][0], j[0][1], j[0][3] or 0, j[0][2][0] or 0, j[0][2][1], j[0][2][2])):
        if built == (gpu_experts, path, chunk_slots):  # the same weights, another copy form: recompile (and move)
            model = _with_copy_form(model, *slots_choice)
        else:
            del model
            gc.collect()  # the next model's host stacks (17 GB at Flash-Next shapes) must not coexist with these
            t0 = time.monotonic()
            model = _build(cfg, quant, gpu_experts, dtype, host_kernel, "compute" if path == "none" else path,
                           slots_choice[0], chunk_slots, *slots_choice[1:])
            built = (gpu_experts, path, chunk_slots)
            print(f"model with {gpu_experts}/{cfg.num_experts} experts per layer on the device ({path}) built in "
                  f"{time.monotonic() - t0:.0f}s", flush=True)
        for row in (new := _measure(args, cfg, model, entries, routings, random_cache)):
            row.update(host_path=path, copy_slots=slots_choice[0] or "auto", stream_copy=slots_choice[1],
                       host_memory=slots_choice[2])
        rows += new
        if args.prefill_tokens and path != "compute":
            rows.append(_time_prefill(args, cfg, model, dict(budget=entries[0][0], budget_mib=entries[0][1],
                                                             gpu_experts=gpu_experts, experts=cfg.num_experts,
                                                             host_path=path, copy_slots=slots_choice[0] or "auto",
                                                             stream_copy=slots_choice[1],
                                                             host_memory=slots_choice[2])))
    return rows


def _with_copy_form(model: LoadedModel, copy_slots: int | None, stream_copy: str, host_memory: str) -> LoadedModel:
    """`model`'s weights (shared, not copied) with every streaming layer staging `copy_slots` rows per round, copied
    in the `stream_copy` form from rows in `host_memory` (moved there, one layer at a time, when it changes)."""
    graph = nnx.merge(model.graphdef, model.state)
    for _, node in nnx.iter_graph(graph):
        if isinstance(node, QuantizedExperts) and node.streaming:
            moved = resolve_host_memory(host_memory) != resolve_host_memory(node.quant.host_memory)
            node.quant = dataclasses.replace(node.quant, copy_slots=copy_slots, stream_copy=stream_copy,
                                             host_memory=host_memory)
            if moved:
                rows = np.asarray(jax.device_get(node.host_rows.get_value()))
                node.host_rows.set_value(to_host_memory(rows, memory=host_memory))
    return LoadedModel(model.path, model.config, graph, model.dtype, [], None, host_pool=model.host_pool)


def _measure(args, cfg, model: LoadedModel, entries, routings, random_cache) -> list[dict]:
    graphdef, state = model.graphdef, model.state
    placement = ExpertPlacement(state, graphdef, PlacementConfig(every=args.placement_every))
    placement.warm_up()
    decode = (jit_step_donating_counts(decode_step, graphdef, state) if args.donate_counts and placement.active
              else jit_step(decode_step, graphdef, state))
    # As the engine's runner: weights as a flat list, re-read only after the placement rewrote the state, each
    # step's counters put into it (and into the state) in between.
    flat = FlatWeights(state, lambda: placement.writes)

    def inputs(s):
        z = jnp.zeros(s)
        tokens = jnp.asarray(np.random.default_rng(s).integers(0, cfg.vocab_size, s), jnp.int32)
        return (tokens, jnp.ones(s, bool), (), z, z.astype(jnp.int32), z + 1, z.astype(jnp.uint32))

    def compile_one(s):
        cache = jax.eval_shape(lambda: random_cache(cfg, s, args.ctx, args.fill, model.dtype))
        t0 = time.monotonic()
        compiled = decode.lower(flat.get(), cache, *inputs(s)).compile()
        hlo = compiled.as_text()
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"{_row_name(entries[0][0], s, model)}.hlo.txt"), "w") as f:
                f.write(hlo)
        graphs, launches = host_launches(hlo)
        launch_stats[s] = dict(kernels=count_kernels(hlo), host_launches=launches, command_buffers=graphs)
        print(f"compiled decode[{s}] ({placement.layers[0].module.pool_size if placement.active else 'all'} "
              f"experts on the device) in {time.monotonic() - t0:.0f}s: {launch_stats[s]['kernels']} kernels, "
              f"{launches} host launches ({graphs} command buffers)", flush=True)
        return s, compiled

    launch_stats: dict[int, dict] = {}  # slots -> the compiled step's kernels, host launches, command buffers
    slots = sorted({s for _, _, s, _ in entries})
    with concurrent.futures.ThreadPoolExecutor(len(slots)) as pool:
        compiled = dict(pool.map(compile_one, slots))
    rows = []
    for label, mib, s, plan in entries:
        for routing in routings:
            set_routing(state, routing, args.zipf_s)
            flat.invalidate()  # the routing biases were rewritten: re-read the state
            for layer in placement.layers:
                layer.score[:] = 0.0
            for kernel in args.host_kernel.split(",") if placement.active else ["-"]:
                if placement.active:
                    model.host_pool.use_kernel(kernel)
                rows.append(_time_row(args, cfg, model, placement, compiled[s], flat, inputs(s), random_cache,
                                      dict(budget=label, budget_mib=mib, gpu_experts=plan.gpu_experts,
                                           experts=plan.num_experts, slots=s, routing=routing, host_kernel=kernel,
                                           **launch_stats[s])))
    return rows


def _row_name(budget: str, slots: int, model: LoadedModel) -> str:
    """A file name for one compiled step: budget, slots and the streaming layers' copy form and host memory."""
    quant = next((node.quant for _, node in nnx.iter_graph(nnx.merge(model.graphdef, model.state))
                  if isinstance(node, QuantizedExperts) and node.streaming), None)
    form = "resident" if quant is None else f"{quant.stream_copy}-{quant.host_memory}-{quant.copy_slots or 'auto'}"
    return f"{budget}_{slots}_{form}"


def _time_row(args, cfg, model: LoadedModel, placement: ExpertPlacement, fn, flat: FlatWeights, ins, random_cache,
              row: dict) -> dict:
    """Warm-up steps (placement adapts), then `args.steps` timed decode steps -> the row with its measurements."""
    s = row["slots"]
    cache = random_cache(cfg, s, args.ctx, args.fill, model.dtype)

    def step(cache, ins):
        out = fn(flat.get(), cache, *ins)
        flat.put_counts(out[3])
        tokens = np.asarray(out[0])  # the engine reads the tokens every step ...
        placement.tick()
        return out[2], (jnp.asarray(tokens), *ins[1:])  # ... and feeds them back

    for _ in range(args.warm_steps):
        cache, ins = step(cache, ins)
    placement.round(place=False)
    before = placement.stats()
    host_before = model.host_pool.busy()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        cache, ins = step(cache, ins)
        times.append(time.perf_counter() - t0)
    # The same steps back to back, nothing read between them and placement untouched: the gap to ms/step is what
    # the host adds per step (token read, placement); this figure is the device's (and the launches').
    counters = getattr(fn, "counters", None)  # donated counters (--donate-counts): each step's feed the next
    w = list(flat.get())
    for i in counters or ():
        w[i] = jnp.copy(w[i])  # the copies are consumed, the state's counters (the timed steps' counts) kept

    def chained(cache, ins):
        out = fn(w, cache, *ins)
        for i, a in zip(counters or (), jax.tree_util.tree_leaves(out[3])):
            w[i] = a
        return out, out[2], (out[0], *ins[1:])

    t0 = time.perf_counter()
    for _ in range(args.steps):
        out, cache, ins = chained(cache, ins)
    jax.block_until_ready(out[0])
    chained_ms = (time.perf_counter() - t0) / args.steps * 1e3
    if args.profile:  # two more steps back to back under the profiler (`python -m strata_jax.bench.profile`)
        with jax.profiler.trace(os.path.join(args.profile, f"{_row_name(row['budget'], s, model)}_{row['routing']}"),
                                create_perfetto_trace=True):
            for _ in range(2):
                out, cache, ins = chained(cache, ins)
            jax.block_until_ready(out[0])
    placement.round(place=False)
    after = placement.stats()
    host_calls, host_s = (b - a for a, b in zip(host_before, model.host_pool.busy()))
    streamed_mb = (after.get("expert_streamed_bytes_total", 0) - before.get("expert_streamed_bytes_total", 0)) / 1e6
    staged = after.get("expert_streamed_experts_total", 0) - before.get("expert_streamed_experts_total", 0)
    pairs = after.get("expert_pairs_total", 0) - before.get("expert_pairs_total", 0)
    hits = after.get("expert_gpu_pairs_total", 0) - before.get("expert_gpu_pairs_total", 0)
    step_ms = statistics.median(times) * 1e3
    row.update(step_ms=step_ms, mean_step_ms=statistics.mean(times) * 1e3, tok_s=s / step_ms * 1e3,
               hit_rate=hits / pairs if placement.active and pairs else 1.0,
               promotions=after.get("expert_promotions_total", 0), host_ms=host_s / args.steps * 1e3,
               host_calls=host_calls / args.steps, host_pairs=(pairs - hits) / args.steps,
               streamed_mb=streamed_mb / args.steps, staged_experts=staged / args.steps, chained_ms=chained_ms)
    print(f"budget {row['budget']} ({row['budget_mib']} MiB, {row['gpu_experts']}/{row['experts']} experts on the "
          f"device), {s} slots, {row['routing']}: {row['tok_s']:.1f} tok/s ({step_ms:.1f} ms/step), hit rate "
          f"{row['hit_rate']:.1%}; host kernel {row['host_kernel']}: {row['host_ms']:.1f} ms/step in "
          f"{row['host_calls']:.0f} callbacks for {row['host_pairs']:.0f} pairs; streamed "
          f"{row['streamed_mb']:.1f} MB per step ({row['staged_experts']:.1f} experts staged); back to back "
          f"{chained_ms:.1f} ms/step", flush=True)
    return row


def _time_prefill(args, cfg, model: LoadedModel, row: dict) -> dict:
    """An `args.prefill_tokens`-token prompt on one slot through the engine's prefill step in chunks of
    `args.prefill_chunk` (warmed once, then timed); returns `row` with the time to the first token and the MB
    streamed."""
    graphdef, state = model.graphdef, model.state
    placement = ExpertPlacement(state, graphdef, PlacementConfig(every=0))
    flat = FlatWeights(state, lambda: placement.writes)
    step = jit_step(prefill_step, graphdef, state)
    n, c = args.prefill_tokens, args.prefill_chunk
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, -(-n // c) * c).astype(np.int32)

    def prompt() -> float:
        cache = init_cache(cfg, 1, -(-n // c) * c + 64, model.dtype)
        t0 = time.perf_counter()
        for start in range(0, n, c):
            chunk = tokens[start:start + c][None]
            last = start + c >= n
            args_ = prefill_args([0], chunk, [min(c, n - start)], [-1 if last else int(tokens[start + c])],
                                 greedy_sampling(1), (), model.dtype)
            # Each chunk counts on from the streaming counters the one before returned, as in the engine.
            out = step(flat.get(), cache, *args_)
            cache = out[2]
            flat.put_counts(out[3])
        np.asarray(out[0])
        return time.perf_counter() - t0

    prompt()  # compiles
    placement.round(place=False)
    before = placement.stats()
    seconds = prompt()
    placement.round(place=False)
    after = placement.stats()
    streamed_mb = (after.get("expert_streamed_bytes_total", 0) - before.get("expert_streamed_bytes_total", 0)) / 1e6
    row.update(prefill_tokens=n, prefill_chunk=c, ttft_s=seconds, prefill_streamed_mb=streamed_mb)
    print(f"budget {row['budget']} ({row['gpu_experts']}/{row['experts']} experts on the device, {row['host_path']}): "
          f"{n}-token prefill in chunks of {c}: {seconds:.3f} s ({n / seconds:,.0f} tok/s), streamed "
          f"{streamed_mb:,.1f} MB", flush=True)
    return row


def print_tier_table(rows: list[dict]) -> None:
    print("\n| budget | experts on GPU | host path (copy slots, copy form, memory) | slots | routing | host kernel "
          "| decode tok/s | ms/step (back to back) | host launches (graphs) | host ms/step (pairs) "
          "| streamed MB/step (experts) | GPU hit rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['budget']} ({r['budget_mib']} MiB) | refused | - | {r['slots']} | - | - | - | - | - | - "
                  "| - | - |")
            continue
        if "ttft_s" in r:
            continue
        print(f"| {r['budget']} ({r['budget_mib']} MiB) | {r['gpu_experts']}/{r['experts']} "
              f"| {r.get('host_path', 'compute')} ({r.get('copy_slots', '-')}, {r.get('stream_copy', '-')}, "
              f"{r.get('host_memory', '-')}) "
              f"| {r['slots']} "
              f"| {r['routing']} | {r['host_kernel']} | {r['tok_s']:.1f} | {r['step_ms']:.1f} ({r['chained_ms']:.1f}) "
              f"| {r['host_launches']} ({r['command_buffers']}) | {r['host_ms']:.1f} "
              f"({r['host_pairs']:.0f}) | {r.get('streamed_mb', 0):.1f} ({r.get('staged_experts', 0):.1f}) "
              f"| {r['hit_rate']:.1%} |")
    prefill = [r for r in rows if "ttft_s" in r]
    if prefill:
        print("\n| budget | experts on GPU | host path | prompt tokens (chunk) | TTFT s | streamed MB |")
        print("|---|---|---|---|---|---|")
        for r in prefill:
            print(f"| {r['budget']} ({r['budget_mib']} MiB) | {r['gpu_experts']}/{r['experts']} | {r['host_path']} "
                  f"| {r['prefill_tokens']} ({r['prefill_chunk']}) | {r['ttft_s']:.3f} | "
                  f"{r['prefill_streamed_mb']:,.1f} |")


def tier_args(p) -> None:
    """Adds the tier-mode flags to the bench's parser (--slots, --ctx, --fill, --steps, --planes, --group, --impl,
    --dtype, --routing, --zipf-s, --vram-reserve-mib are shared with the other modes)."""
    p.add_argument("--budgets", default="all,half,quarter",
                   help="tier mode: comma-separated budgets: all | half | quarter (that share of the experts on "
                   "the device, the rest planned as usual) or MiB (e.g. 24576,12288)")
    p.add_argument("--warm-steps", type=int, default=48, help="tier mode: untimed decode steps before timing")
    p.add_argument("--host-kernel", default="xla",
                   help="tier mode: comma-separated host kernels to time on the same model: xla (compiled by "
                   "XLA:CPU, default) and/or numpy (the reference)")
    p.add_argument("--placement-every", type=int, default=8, help="tier mode: steps between placement rounds")
    p.add_argument("--host-path", default="compute",
                   help="tier mode: comma-separated ways to serve the experts outside the pool: compute (the host "
                   "CPU, default) and/or stream (pinned host memory copied into the step); users mode (with "
                   "--vram-budget-mib or --gpu-experts): one of them")
    p.add_argument("--compute-budgets", default="",
                   help="tier mode: budgets (as in --budgets) that also get a host-compute row (default: none)")
    p.add_argument("--copy-slots", default="auto",
                   help="tier mode, stream: comma-separated staging rows per decode round to compare (default auto: "
                   "sized per call from its pairs and the pool's share)")
    p.add_argument("--stream-copy", default="auto",
                   help="tier mode, stream: comma-separated forms of the copy to compare: slices (one copy per "
                   "staging row), pallas (one kernel reading the host rows, dead rows skipped), auto (default: "
                   "pallas on a GPU, slices elsewhere)")
    p.add_argument("--donate-counts", action=argparse.BooleanOptionalAction, default=True,
                   help="tier and users modes: the steps consume the routing counters they are given and write the "
                   "next ones in place, so that the step's CUDA graphs need no update every step (the engine's "
                   "default, EngineConfig.donate_counts; --no-donate-counts: new buffers every step, to compare)")
    p.add_argument("--host-memory", default="auto",
                   help="tier mode, stream: comma-separated places for the streamed rows to compare: pinned (jax's "
                   "pinned host memory), mapped (pinned host memory the GPU reads in place, a device array to XLA), "
                   "auto (default: pinned)")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="tier mode: also time a prompt of this many tokens on every streaming or all-resident "
                   "model (default 0: off)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="tier mode: prompt chunk for --prefill-tokens")

