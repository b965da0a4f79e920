"""`python -m strata_jax.bench --mode hyper`: one hyper-connection call (the block-input mix, its inject weights and
the pending injection folded in, as the decoder's MLP hyper-connection runs it) at a preset's shapes, per
implementation.

The jnp form (what XLA fuses, the default) is the baseline. `prefold` is `strata_jax.model.hyper.prefold_mix`, an
XLA formulation with the down and inject projections as one GEMM against weights transformed at load time (the
step's `--hyper-prefold`). `k<K>_w<W>` is the three Pallas kernels of `pallas_kernels.hyper_mix` with at most K
columns of a stream group per program of the projection kernel, and W warps. `--hyper-iters` calls, each with its
own weights (so none is found in L2) and fed the previous call's outputs, run one after another inside one jitted
function, as the model's layers do. The floor is the weights plus the streams read and written, over the copy
bandwidth measured in the same run."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.hyper_mix import hyper_mix
from strata_jax.bench.common import max_rel_diff, median_seconds, print_variant_table
from strata_jax.bench.floors import copy_bandwidth
from strata_jax.model.hyper import prefold_mix, prefolded
from strata_jax.bench.synthetic import preset_config

_VARIANT = re.compile(r"k(\d+)_w(\d+)")


def hyper_args(p) -> None:
    """Adds the hyper-mode flags (--slots is unused; --preset, --steps and --bandwidth-gib are shared)."""
    p.add_argument("--hyper-tokens", default="1,8,32", help="hyper mode: comma-separated tokens per call")
    p.add_argument("--hyper-variants", default="jnp,prefold,k256_w4,k512_w4",
                   help="hyper mode: jnp | prefold | k<block_k>_w<warps> (the Pallas kernels), comma-separated")
    p.add_argument("--hyper-iters", type=int, default=24, help="hyper mode: calls per timed run, own weights each")


def _mix_fn(variant: str, hc: int, eps: float):
    """variant -> f(streams, weights dict, pending) -> (mixed, inject weights, new streams)."""
    if variant == "jnp":
        return lambda s, w, pending: hyper_mix(s, w["g"], w["wd"], w["wu"], w["wi"], hc=hc, eps=eps, pending=pending,
                                               impl="jnp")
    if variant == "prefold":
        return lambda s, w, pending: prefold_mix(s, w["g"], w["proj"], w["wu"], pending, hc=hc, eps=eps)
    match = _VARIANT.fullmatch(variant)
    if match is None:
        raise SystemExit(f"bad --hyper-variants entry {variant!r}: expected jnp, prefold or k<N>_w<W>")
    block_k, warps = int(match[1]), int(match[2])
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run: the kernels' semantics, not their speed
    return lambda s, w, pending: hyper_mix(s, w["g"], w["wd"], w["wu"], w["wi"], hc=hc, eps=eps, pending=pending,
                                           impl="pallas", block_k=block_k, num_warps=warps, interpret=interpret)


def _weights(key, iters: int, hc: int, hidden: int, rank: int, dtype) -> dict:
    width = hc * hidden
    k = jax.random.split(key, 4)
    return {"g": 0.1 * jax.random.normal(k[0], (iters, width), dtype),
            "wd": 2 * jax.random.normal(k[1], (iters, rank, width), dtype) / width**0.5,
            "wu": jax.random.normal(k[2], (iters, width, rank), dtype) / rank**0.5,
            "wi": 2 * jax.random.normal(k[3], (iters, hc, width), dtype) / width**0.5}


def _chained(mix):
    """One jitted function running the calls one after another, each on its own weights (separate arrays, as the
    model's layers hold them: a scan over stacked weights would add a copy of each call's slice)."""
    def run(streams, block_out, inject_w, weights):
        for w in weights:
            block_out, inject_w, streams = mix(streams, w, (block_out, inject_w))
        return streams, block_out, inject_w
    return jax.jit(run)


def run_hyper(args) -> list[dict]:
    """Median time per call of each variant, and its largest difference from the first variant's output (the jnp
    form by default), per token count."""
    cfg = preset_config(args.preset)
    hc, hidden, rank, eps = cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank, cfg.rms_norm_eps
    if hc <= 1:
        raise SystemExit(f"preset {args.preset} has no hyper-connections")
    variants = args.hyper_variants.split(",")
    for variant in variants:  # reject a bad entry before any timing
        _mix_fn(variant, hc, eps)
    dtype = jnp.bfloat16
    stacked = _weights(jax.random.key(0), args.hyper_iters, hc, hidden, rank, dtype)
    weights = [{k: v[i] for k, v in stacked.items()} for i in range(args.hyper_iters)]
    bw = copy_bandwidth(args.bandwidth_gib)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s; {args.preset}: hc {hc} x hidden {hidden}, "
          f"rank {rank}", flush=True)
    weight_bytes = sum(w.nbytes for w in weights[0].values())
    if "prefold" in variants:
        weights = [{**w, "proj": prefolded(w["g"], w["wd"], w["wi"])} for w in weights]
    rows = []
    for t in (int(x) for x in args.hyper_tokens.split(",")):
        ks, ko = jax.random.split(jax.random.key(t))
        inputs = (jax.random.normal(ks, (t, hc * hidden), dtype), jax.random.normal(ko, (t, hidden), dtype),
                  jnp.full((t, hc), 0.5, dtype))
        # streams and the pending block output read, the new streams and mixed written
        floor_us = (weight_bytes + (2 * hc + 2) * t * hidden * 2) / bw * 1e6
        want = None
        for variant in variants:
            f = _chained(_mix_fn(variant, hc, eps))
            out = jax.block_until_ready(f(*inputs, weights))  # compile + warm-up
            mixed = np.asarray(out[1], np.float32)
            if want is None:
                want = mixed
            diff = max_rel_diff(mixed, want)
            us = median_seconds(f, (*inputs, weights), args.steps) / args.hyper_iters * 1e6
            rows.append({"tokens": t, "variant": variant, "us_per_call": us, "floor_us": floor_us,
                         "floor_fraction": floor_us / us, "max_rel_diff": diff})
            print(f"  T {t:3d}: {variant:10s} {us:8.1f} us/call  floor {floor_us:6.1f} us  ({floor_us / us:5.1%})  "
                  f"diff vs {variants[0]} {diff:.1e}", flush=True)
    return rows


def print_hyper_table(rows: list[dict]) -> None:
    print_variant_table(rows, ("tokens",), "us_per_call", "us/call", "max_rel_diff", "max rel diff vs jnp")
