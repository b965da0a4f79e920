"""The host expert tier under a VRAM budget (`python -m strata_jax.bench --mode tier`): for each budget (all experts
on the device, half, a quarter, or a card size in MiB) the planner picks the device pool; a synthetic model at
`--preset` shapes is built with that pool (the other experts in host RAM, computed in numpy), and the decode step
is timed for each slot count with uniform routing and with Zipf-skewed routing (`RoutingBias` = log of a Zipf
distribution over a random permutation of each layer's experts), after hot-expert placement has had
`--warm-steps` steps to adapt. Reports decode tok/s and the pool's hit rate (routed pairs served by the device).

Distinct compiled shapes: one decode step per (pool size, slot count); router biases and placement only change
array values.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import math
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
from strata_jax.engine.planner import MIB, MemoryPlan, device_memory, make_plan
from strata_jax.engine.steps import decode_step, jit_step
from strata_jax.host.pool import HostPool, check_kernel
from strata_jax.model.moe import add_routing_bias
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


def _build(cfg, quant: ExpertQuantization, gpu_experts: int, dtype, host_kernel: str):
    q = ExpertQuantization(quant.planes, quant.group, quant.impl,
                           gpu_experts=None if gpu_experts >= cfg.num_experts else gpu_experts)
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
    jobs: dict[int, list[tuple[str, int, int, MemoryPlan]]] = {}
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
            for s in sorted(x for x in args.slots if x <= top):
                jobs.setdefault(plan.gpu_experts, []).append((label, mib, s, plan))
            break
    for gpu_experts, entries in sorted(jobs.items(), reverse=True):
        t0 = time.monotonic()
        model = _build(cfg, quant, gpu_experts, dtype, host_kernel)
        print(f"model with {gpu_experts}/{cfg.num_experts} experts per layer on the device built in "
              f"{time.monotonic() - t0:.0f}s", flush=True)
        rows += _measure(args, cfg, model, entries, routings, random_cache)
        del model
        gc.collect()  # the next model's host stacks (17 GB at Flash-Next shapes) must not coexist with these
    return rows


def _measure(args, cfg, model: LoadedModel, entries, routings, random_cache) -> list[dict]:
    graphdef, state = model.graphdef, model.state
    placement = ExpertPlacement(state, graphdef, PlacementConfig(every=args.placement_every))
    placement.warm_up()
    # As the engine's ModelRunner does: weights as a flat list, flattened once unless a host tier's
    # placement rewrites them between steps.
    decode = jit_step(decode_step, graphdef, state)
    fixed = None if placement.active else jax.tree_util.tree_leaves(state)

    def weights():
        return fixed if fixed is not None else jax.tree_util.tree_leaves(state)

    def inputs(s):
        z = jnp.zeros(s)
        tokens = jnp.asarray(np.random.default_rng(s).integers(0, cfg.vocab_size, s), jnp.int32)
        return (tokens, jnp.ones(s, bool), (), z, z.astype(jnp.int32), z + 1, z.astype(jnp.uint32))

    def compile_one(s):
        cache = jax.eval_shape(lambda: random_cache(cfg, s, args.ctx, args.fill, model.dtype))
        t0 = time.monotonic()
        compiled = decode.lower(weights(), cache, *inputs(s)).compile()
        print(f"compiled decode[{s}] ({placement.layers[0].module.pool_size if placement.active else 'all'} "
              f"experts on the device) in {time.monotonic() - t0:.0f}s", flush=True)
        return s, compiled

    slots = sorted({s for _, _, s, _ in entries})
    with concurrent.futures.ThreadPoolExecutor(len(slots)) as pool:
        compiled = dict(pool.map(compile_one, slots))
    rows = []
    for label, mib, s, plan in entries:
        for routing in routings:
            set_routing(state, routing, args.zipf_s)
            for layer in placement.layers:
                layer.score[:] = 0.0
            for kernel in args.host_kernel.split(",") if placement.active else ["-"]:
                if placement.active:
                    model.host_pool.use_kernel(kernel)
                rows.append(_time_row(args, cfg, model, placement, compiled[s], weights, inputs(s), random_cache,
                                      dict(budget=label, budget_mib=mib, gpu_experts=plan.gpu_experts,
                                           experts=plan.num_experts, slots=s, routing=routing, host_kernel=kernel)))
    return rows


def _time_row(args, cfg, model: LoadedModel, placement: ExpertPlacement, fn, weights, ins, random_cache,
              row: dict) -> dict:
    """Warm-up steps (placement adapts), then `args.steps` timed decode steps -> the row with its measurements."""
    s = row["slots"]
    cache = random_cache(cfg, s, args.ctx, args.fill, model.dtype)

    def step(cache, ins):
        out = fn(weights(), cache, *ins)
        placement.store_counts(out[3])
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
    placement.round(place=False)
    after = placement.stats()
    host_calls, host_s = (b - a for a, b in zip(host_before, model.host_pool.busy()))
    pairs = after.get("expert_pairs_total", 0) - before.get("expert_pairs_total", 0)
    hits = after.get("expert_gpu_pairs_total", 0) - before.get("expert_gpu_pairs_total", 0)
    step_ms = statistics.median(times) * 1e3
    row.update(step_ms=step_ms, mean_step_ms=statistics.mean(times) * 1e3, tok_s=s / step_ms * 1e3,
               hit_rate=hits / pairs if placement.active and pairs else 1.0,
               promotions=after.get("expert_promotions_total", 0), host_ms=host_s / args.steps * 1e3,
               host_calls=host_calls / args.steps, host_pairs=(pairs - hits) / args.steps)
    print(f"budget {row['budget']} ({row['budget_mib']} MiB, {row['gpu_experts']}/{row['experts']} experts on the "
          f"device), {s} slots, {row['routing']}: {row['tok_s']:.1f} tok/s ({step_ms:.1f} ms/step), hit rate "
          f"{row['hit_rate']:.1%}; host kernel {row['host_kernel']}: {row['host_ms']:.1f} ms/step in "
          f"{row['host_calls']:.0f} callbacks for {row['host_pairs']:.0f} pairs", flush=True)
    return row


def print_tier_table(rows: list[dict]) -> None:
    print("\n| budget | experts on GPU | slots | routing | host kernel | decode tok/s | ms/step | host ms/step "
          "(pairs) | GPU hit rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['budget']} ({r['budget_mib']} MiB) | refused | {r['slots']} | - | - | - | - | - | - |")
            continue
        print(f"| {r['budget']} ({r['budget_mib']} MiB) | {r['gpu_experts']}/{r['experts']} | {r['slots']} "
              f"| {r['routing']} | {r['host_kernel']} | {r['tok_s']:.1f} | {r['step_ms']:.1f} | {r['host_ms']:.1f} "
              f"({r['host_pairs']:.0f}) | {r['hit_rate']:.1%} |")


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
