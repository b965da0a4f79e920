"""`bench --mode mesh`: the engine's decode step over a device mesh against the same step without one.

A synthetic model at --preset shapes (every expert on the device), the engine's `ModelRunner` at each --slots
count, a random cache with --fill tokens per slot; each variant times --steps decode steps launched back to back on
the previous step's tokens (as the engine's overlapped decode does), so the figure is the step as the engine
runs it, host launch included. Variants: "none" (today's step, one device), then the sharded path over
--devices devices (1 on one GPU: what the mesh code path costs; 2 or more: expert parallel) for each exchange in
--exchanges. Results in docs/PERF.md, "Several devices".
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.engine.config import EngineConfig
from strata_jax.engine.mesh import MeshConfig, MeshSteps
from strata_jax.engine.runner import ModelRunner, RunnerModel
from strata_jax.engine.steps import greedy_sampling
from strata_jax.bench.synthetic import preset_config, random_cache, synthetic_model
from strata_jax.model.config import ExpertQuantization
from strata_jax.model.expert_parallel import shard_state


def _time_decode(runner: ModelRunner, slots: int, steps: int) -> float:
    """ms per decode step, `steps` steps launched back to back (two untimed first: compilation, first run)."""
    tokens = jnp.zeros((slots,), jnp.int32)
    active, sampling = np.ones(slots, bool), greedy_sampling(slots)
    for _ in range(2):
        tokens = runner.decode_on_device(tokens, active, sampling).tokens
    jax.block_until_ready(tokens)
    started = time.perf_counter()
    for _ in range(steps):
        tokens = runner.decode_on_device(tokens, active, sampling).tokens
    jax.block_until_ready(tokens)
    return (time.perf_counter() - started) / steps * 1e3


def run_mesh_bench(args) -> list[dict]:
    """Rows {variant, devices, exchange, slots, step_ms, tok_s, vs_none} for every variant and --slots count."""
    cfg = preset_config(args.preset)
    if cfg.ple_layers:
        raise ValueError("--mode mesh times the overlapped decode, which a model with PLE layers does not use")
    devices = args.devices or 1
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    quant = ExpertQuantization(planes=args.planes, group=args.group, impl=args.impl)
    model = synthetic_model(cfg, jnp.bfloat16, quant)
    graphdef, state = nnx.split(model)
    variants: list[tuple[str, MeshConfig | None]] = [("none", None)]
    variants += [(f"mesh {devices} dev, {ex}", MeshConfig(1, devices, ex)) for ex in args.exchanges.split(",")]
    rows: list[dict] = []
    base: dict[int, float] = {}
    for name, mesh_config in variants:
        mesh = None if mesh_config is None else mesh_config.make()
        if mesh is not None:
            shard_state(state, mesh)  # in place: later variants use the same placement
        exchange = "gather" if mesh_config is None else mesh_config.exchange
        runner_model = RunnerModel(graphdef, state, cfg, jnp.bfloat16, False, mesh, exchange)
        for slots in args.slots:
            runner = ModelRunner(runner_model, EngineConfig(slots=slots, max_context=args.ctx, prefill_chunks=(32,)))
            cache = random_cache(cfg, slots, args.ctx, args.fill, jnp.bfloat16)
            runner.cache = cache if mesh is None else MeshSteps(mesh, slots).place_cache(cache)
            ms = _time_decode(runner, slots, args.steps)
            del runner, cache
            if mesh is None:
                base[slots] = ms
            row = {"variant": name, "devices": 1 if mesh is None else mesh.size, "exchange": exchange,
                   "slots": slots, "ctx": args.ctx, "fill": args.fill, "step_ms": ms, "tok_s": slots / ms * 1e3,
                   "vs_none": ms / base[slots] if slots in base else None}
            rows.append(row)
            print(f"{name}: decode[{slots}] {ms:.2f} ms/step ({row['tok_s']:.0f} tok/s)"
                  + (f", {row['vs_none']:.3f}x the step without a mesh" if row["vs_none"] else ""), flush=True)
    return rows


def print_mesh_table(rows: list[dict]) -> None:
    print(f"{'variant':<28} {'slots':>5} {'step ms':>8} {'tok/s':>8} {'vs none':>8}")
    for r in rows:
        vs = f"{r['vs_none']:.3f}" if r["vs_none"] else "-"
        print(f"{r['variant']:<28} {r['slots']:>5} {r['step_ms']:>8.2f} {r['tok_s']:>8.0f} {vs:>8}")


def mesh_args(p) -> None:
    """The mesh mode's options (--devices and --mesh are shared with users mode)."""
    g = p.add_argument_group("mesh mode (--preset, --slots, --ctx, --fill, --steps, --devices)")
    g.add_argument("--exchanges", default="gather,all_to_all",
                   help="token exchanges to time over the mesh, comma-separated (default: gather,all_to_all)")
