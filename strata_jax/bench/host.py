"""Host expert benchmarks on random packed experts at `--preset` shapes (`python -m strata_jax.bench`):

* `--mode host`: one MoE layer's host work alone (`HostTier.compute`, the real worker pool), per `--host-kernel`
  (numba, xla, numpy), for each (tokens, host pairs) of `--host-pairs`, with the packed weight bytes it reads per
  second against the host's memory bandwidth (`host_copy_bandwidth`: numpy copies of a large array on as many
  threads as the pool has workers). No device involved.
* `--mode roundtrip`: what a host callback costs inside a jitted program and whether splitting it pays. 48
  "layers", each with device work the size of a decode layer's expert kernel (a bf16 matvec over ~130 MB, ~50 us
  on an H200) and one layer's host pairs, timed as: device work only; plus a callback that returns zeros (the
  bare round trip); plus the host experts in one callback after the device work (the engine's design,
  `serial`); and split in two callbacks around the device work (`split`: the first hands the pairs to a thread
  and returns, the second waits and adds) so the host computes while the device works.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.bench.kernels import routings, time_fn
from strata_jax.host.experts_numba import threading_layer
from strata_jax.host.pool import HostPool
from strata_jax.host.tier import HostTier
from strata_jax.bench.synthetic import preset_config

LAYERS = 48
ROUNDTRIP_MODES = ("device", "noop", "serial", "split")


def _random_tier(args, cfg, experts: int) -> HostTier:
    """A host tier of `experts` random packed experts at the config's shapes (`--planes`, `--group`), on a pool of
    `--pool-workers` threads."""
    e, h, i, g, p = experts, cfg.hidden_size, cfg.moe_intermediate_size, args.group, args.planes
    rng = np.random.default_rng(0)
    tier = HostTier(g, HostPool(workers=args.pool_workers))
    for name, shape in (("gate_up", (e, p, h, 2 * i)), ("down", (e, p, i, h))):
        *lead, k, n = shape
        tier.set(f"{name}_bits", rng.integers(0, 2**32, (*lead, k // 32, n), dtype=np.uint64).astype(np.uint32))
        tier.set(f"{name}_scales", jnp.asarray(rng.uniform(0.01, 0.05, (*lead, -(-k // g), n)), jnp.bfloat16))
    return tier


def _pairs(spec: str, k: int) -> tuple[int, int]:
    t, pairs = (int(v) for v in spec.split(":"))
    if not 1 <= pairs <= t * k:
        raise ValueError(f"--host-pairs {spec}: {t} token(s) route 1..{t * k} pairs (top-{k})")
    return t, pairs


def _routing(rng, t: int, pairs: int, experts: int, k: int):
    """A random routing of t tokens (`bench_kernels.routings`): ids [t, k], weights [t, k], and a mask of `pairs`
    pairs."""
    (ids,), (w,) = routings(rng, 1, t, k, experts)
    mask = np.zeros(t * k, bool)
    mask[rng.choice(t * k, pairs, replace=False)] = True
    return ids, w, mask.reshape(t, k)


def host_copy_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Bytes/s (read + written) of numpy copying a `mib` MiB array into another, split over `threads` threads (numpy
    drops the GIL while copying): the host's memory bandwidth as plain numpy reaches it, best of `reps`."""
    src = np.random.default_rng(0).integers(0, 255, mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size // 4096 + 1) * 4096, threads)
    spans = [(int(p[0]), int(min(src.size, p[-1] + 4096))) for p in parts if p.size]

    def copy(span):
        np.copyto(dst[span[0]:span[1]], src[span[0]:span[1]])

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, spans))  # first touch
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(copy, spans))
            best = min(best, time.perf_counter() - t0)
    return 2 * src.size / best


def _time_wall_and_cpu(fn, args, reps: int) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds (all threads) of `fn(*args)` over `reps` calls after two
    warm-up calls. On a shared, loaded machine the CPU time is the steadier of the two (a thread waiting for a core
    costs wall time, not CPU time)."""
    fn(*args)
    fn(*args)
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn(*args)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return float(np.median(wall)), float(np.median(cpu))


def _expert_bytes(tier: HostTier) -> int:
    """Packed bytes of one expert (gate_up and down bits and scales): what a kernel reads per distinct expert."""
    return sum(np.asarray(tier._arrays[name][0]).nbytes for name in tier._KINDS)


def run_host_layer(args) -> list[dict]:
    """`--mode host`: median latency of one layer's `HostTier.compute` over `--steps` calls, per kernel and
    (tokens, host pairs), and the packed bytes of the distinct experts it reads per second against the host's copy
    bandwidth on the pool's threads."""
    cfg = preset_config(args.preset)
    e, k = min(cfg.num_experts, 64), cfg.num_experts_per_tok
    tier = _random_tier(args, cfg, e)
    per_expert = _expert_bytes(tier)
    copy_bw = host_copy_bandwidth(tier.pool.workers)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {tier.pool.workers} pool workers; {e} experts at {args.preset} shapes, {per_expert / 1e3:.1f} KB "
          f"packed per expert; numpy copy on {tier.pool.workers} thread(s) {copy_bw / 1e9:.1f} GB/s (read + write); "
          f"load average {load:.2f} on {os.cpu_count()} CPUs", flush=True)
    rng = np.random.default_rng(1)
    rows = []
    for kernel in args.host_kernel.split(","):
        tier.use_kernel(kernel)
        tier.warm_up(8)
        if kernel == "numba" and tier.pool.workers > 1:
            print(f"numba: threading layer {threading_layer()} (NUMBA_THREADING_LAYER overrides)", flush=True)
        for spec in args.host_pairs.split(","):
            t, pairs = _pairs(spec, k)
            x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
            ids, w, mask = _routing(rng, t, pairs, e, k)
            wall, cpu = _time_wall_and_cpu(tier.compute, (x, ids, w, mask), args.steps)
            ms, cpu_ms = wall * 1e3, cpu * 1e3
            read = np.unique(ids[mask]).size * per_expert  # bytes of the distinct experts the pairs route to
            rows.append({"host_kernel": kernel, "tokens": t, "pairs": pairs, "layer_ms": ms, "pair_ms": ms / pairs,
                         "cpu_ms": cpu_ms, "weight_gb_s": read / ms / 1e6, "copy_gb_s": copy_bw / 1e9,
                         "floor_ms": read / copy_bw * 1e3, "workers": tier.pool.workers, "load_average": load})
            print(f"{kernel}: {t} token(s), {pairs} host pairs: {ms:.2f} ms per layer ({ms / pairs:.3f} ms per pair, "
                  f"{read / ms / 1e6:.2f} GB/s of packed weights; {cpu_ms:.2f} ms of CPU time)", flush=True)
    return rows


def print_host_table(rows: list[dict]) -> None:
    """Markdown: ms per layer (and GB/s of packed weights) for each kernel, each later kernel's time over the
    first's, and the floor: the distinct experts' bytes at the measured copy bandwidth."""
    kernels = list(dict.fromkeys(r["host_kernel"] for r in rows))
    cols = [f"{k} ms/layer (GB/s; CPU ms)" for k in kernels] + [f"{k} / {kernels[0]}" for k in kernels[1:]]
    print("\n| tokens | host pairs | floor ms | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    by = {(r["host_kernel"], r["tokens"], r["pairs"]): r for r in rows}
    for t, pairs in dict.fromkeys((r["tokens"], r["pairs"]) for r in rows):
        got = [by[(k, t, pairs)] for k in kernels]
        cells = [f"{r['layer_ms']:.2f} ({r['weight_gb_s']:.2f}; {r['cpu_ms']:.2f})" for r in got]
        cells += [f"{r['layer_ms'] / got[0]['layer_ms']:.2f}x" for r in got[1:]]
        print(f"| {t} | {pairs} | {got[0]['floor_ms']:.3f} | " + " | ".join(cells) + " |")


def _layers_program(mode: str, tier: HostTier, weight: jax.Array):
    """The jitted 48-layer program of `--mode roundtrip` for one mode (see the module docstring)."""
    starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-bench-split")
    pending: dict[int, concurrent.futures.Future] = {}

    def start(x, ids, w, m):
        handle = len(pending)
        pending[handle] = starter.submit(tier.compute, x, ids, w, m)
        return np.int32(handle)

    def finish(handle, device_out):
        return device_out + pending.pop(int(handle)).result()

    def noop(x, ids, w, m):
        return np.zeros(x.shape, np.float32)

    def program(x, ids, w, masks):
        h = x.shape[1]
        for layer in range(LAYERS):
            out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
            host_args = (x.astype(jnp.float32), ids[layer], w[layer], masks[layer])

            def device(x):
                return (x @ weight)[:, :h].astype(jnp.float32) * 1e-3

            if mode == "device":
                y = device(x)
            elif mode in ("noop", "serial"):
                y = device(x) + jax.pure_callback(noop if mode == "noop" else tier.compute, out, *host_args)
            else:  # split: the device work waits for the start callback only, the finish waits for both
                handle = jax.pure_callback(start, jax.ShapeDtypeStruct((), jnp.int32), *host_args)
                handle, x_after = jax.lax.optimization_barrier((handle, x))
                y = jax.pure_callback(finish, out, handle, device(x_after))
            x = jnp.tanh(x + (y * 1e-3).astype(x.dtype))
        return x

    return jax.jit(program)


def run_roundtrip(args) -> list[dict]:
    """`--mode roundtrip`: per-layer cost of each of `ROUNDTRIP_MODES` for each (tokens, host pairs)."""
    cfg = preset_config(args.preset)
    e, k, h = min(cfg.num_experts, 32), cfg.num_experts_per_tok, cfg.hidden_size
    tier = _random_tier(args, cfg, e)
    tier.warm_up(8)
    rng = np.random.default_rng(1)
    weight = jnp.asarray(rng.standard_normal((h, 10 * h)) * 0.01, jnp.bfloat16)
    print(f"device: {jax.devices()[0].device_kind}; host kernel {tier.kernel}, "
          f"{tier.pool.workers} pool workers", flush=True)
    programs = {mode: _layers_program(mode, tier, weight) for mode in ROUNDTRIP_MODES}
    rows = []
    for spec in args.host_pairs.split(","):
        t, pairs = _pairs(spec, k)
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        routing = [_routing(rng, t, pairs, e, k) for _ in range(LAYERS)]
        ids, w, masks = (jnp.asarray(np.stack(a)) for a in zip(*routing))
        row = {"tokens": t, "pairs": pairs}
        for mode in ROUNDTRIP_MODES:
            row[f"{mode}_ms"] = time_fn(programs[mode], (x, ids, w, masks), args.steps)[0] * 1e3 / LAYERS
            print(f"{t} token(s), {pairs} host pairs per layer, {mode}: {row[f'{mode}_ms']:.3f} ms per layer",
                  flush=True)
        rows.append(row)
    return rows


def print_roundtrip_table(rows: list[dict]) -> None:
    print("\n| tokens | host pairs | " + " | ".join(f"{m} ms/layer" for m in ROUNDTRIP_MODES) + " | split / serial |")
    print("|---|---|" + "---|" * (len(ROUNDTRIP_MODES) + 1))
    for r in rows:
        print(f"| {r['tokens']} | {r['pairs']} | " + " | ".join(f"{r[f'{m}_ms']:.3f}" for m in ROUNDTRIP_MODES) +
              f" | {r['split_ms'] / r['serial_ms']:.2f}x |")


def host_args(p) -> None:
    """Adds the host/roundtrip-mode flags (--host-kernel is the tier mode's; --steps, --planes, --group shared)."""
    p.add_argument("--host-pairs", default="1:3,1:7,1:10,8:40",
                   help="host and roundtrip modes: comma-separated TOKENS:PAIRS, the host pairs of one layer")
    p.add_argument("--pool-workers", type=int, default=None,
                   help="host and roundtrip modes: host expert pool threads (default: the CPU quota, minus one)")
