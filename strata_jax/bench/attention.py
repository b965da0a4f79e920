"""`python -m strata_jax.bench --mode attention`: one decode-attention call (a few new tokens per slot over a slot's
KV cache, as the attention layers run it at decode and speculative verify) at a preset's head shapes, per
implementation.

The jnp form (`pallas_kernels.decode_attention.attention_jnp`: every cache position scored, then masked) is the
baseline. `pallas` is the Pallas kernel of `pallas_kernels.decode_attention` with its default splits, block and warps;
`s<S>_k<K>_w<W>` is the kernel with S splits per (slot, kv head), blocks of K keys and W warps. Every slot
holds `--fill` tokens before the call's T, and each token sees the positions up to its own (causal, no QSA
selection). `--attn-iters` calls, each over its own K and V cache (so none is found in L2, as the model's attention
layers hold theirs) and fed a query nudged by the previous call's output, run one after another inside one jitted
function. The floor is the filled part of K and V plus the query and output, over the copy bandwidth measured in the
same run."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import decode_attention
from strata_jax.bench.common import max_rel_diff, median_seconds, print_variant_table
from strata_jax.bench.floors import copy_bandwidth
from strata_jax.bench.synthetic import preset_config

_VARIANT = re.compile(r"s(\d+)_k(\d+)_w(\d+)")


def attention_args(p) -> None:
    """Adds the attention-mode flags (--slots, --ctx, --fill, --preset, --steps and --bandwidth-gib are shared)."""
    p.add_argument("--attn-tokens", default="1,5", help="attention mode: comma-separated tokens per slot per call")
    p.add_argument("--attn-variants", default="jnp,pallas",
                   help="attention mode: jnp | pallas (the kernel's defaults) | s<splits>_k<block_k>_w<warps> (the "
                        "Pallas kernel with those settings), comma-separated")
    p.add_argument("--attn-iters", type=int, default=12, help="attention mode: calls per timed run, own cache each")


def _attend_fn(variant: str):
    """variant -> f(q, k, v, mask, lengths) -> [B, T, Hk, G, D]."""
    if variant == "jnp":
        return lambda *a: decode_attention(*a, impl="jnp")
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run: the kernel's semantics, not its speed
    if variant == "pallas":
        return lambda *a: decode_attention(*a, impl="pallas", interpret=interpret)
    match = _VARIANT.fullmatch(variant)
    if match is None:
        raise SystemExit(f"bad --attn-variants entry {variant!r}: expected jnp, pallas or "
                         "s<splits>_k<block_k>_w<warps>")
    splits, block_k, warps = (int(g) for g in match.groups())
    if splits < 1:
        raise SystemExit(f"bad --attn-variants entry {variant!r}: splits must be at least 1")
    return lambda *a: decode_attention(*a, impl="pallas", splits=splits, block_k=block_k, num_warps=warps,
                                       interpret=interpret)


def _shapes(b: int, t: int, ctx: int, hk: int, g: int, d: int) -> list[tuple[tuple[int, ...], object]]:
    """(shape, dtype) of q, k, v, mask and lengths."""
    kv = ((b, hk, ctx, d), jnp.bfloat16)
    return [((b, t, hk, g, d), jnp.bfloat16), kv, kv, ((b, t, ctx), jnp.bool_), ((b,), jnp.int32)]


def _check_shapes(variants: list[str], slots: list[int], tokens: list[int], ctx: int, fill: int, hk: int, g: int,
                  d: int) -> None:
    """Traces every (variant, slots, tokens) abstractly, so that shapes a kernel refuses (block_k not dividing the
    cache, too many tokens, ...) stop the run before the bandwidth probe and any timing."""
    for t in tokens:
        if t < 1 or fill + t > ctx:
            raise SystemExit(f"--fill {fill} + {t} tokens must fit in --ctx {ctx} (and tokens be at least 1)")
    for variant in variants:
        f = _attend_fn(variant)
        for b in slots:
            for t in tokens:
                shapes = _shapes(b, t, ctx, hk, g, d)
                try:
                    jax.eval_shape(f, *(jax.ShapeDtypeStruct(s, dt) for s, dt in shapes))
                except ValueError as e:
                    raise SystemExit(f"--attn-variants entry {variant!r} at {b} slots, {t} tokens, ctx {ctx}: "
                                     f"{e}") from e


def _inputs(key, b: int, t: int, ctx: int, fill: int, hk: int, g: int, d: int, iters: int):
    """(q, [k per call], [v per call], causal mask, lengths): random bf16 everywhere in the caches, also beyond the
    filled positions, so that reading or attending there shows up in the timing or the difference."""
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, hk, g, d), jnp.bfloat16)
    ks = [jax.random.normal(jax.random.fold_in(kk, i), (b, hk, ctx, d), jnp.bfloat16) for i in range(iters)]
    vs = [jax.random.normal(jax.random.fold_in(kv, i), (b, hk, ctx, d), jnp.bfloat16) for i in range(iters)]
    positions = fill + jnp.arange(t)
    mask = jnp.broadcast_to(jnp.arange(ctx)[None, :] <= positions[:, None], (b, t, ctx))
    return q, ks, vs, mask, jnp.full((b,), fill + t, jnp.int32)


def _chained(attend):
    """One jitted function running the calls one after another, each over its own cache (separate arrays, as the
    model's layers hold them: a scan over stacked caches would add a copy of each call's slice). Each call's output
    nudges the next call's query so that XLA can neither drop nor reorder the calls."""
    def run(q, ks, vs, mask, lengths):
        out = q
        for k, v in zip(ks, vs):
            out = attend(q, k, v, mask, lengths)
            q = (q + out * 1e-3).astype(q.dtype)
        return out
    return jax.jit(run)


def run_attention(args) -> list[dict]:
    """Median time per call of each variant, and its largest difference from the first variant's output (the jnp
    form by default), per (slots, tokens)."""
    cfg = preset_config(args.preset)
    hk, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hk
    variants = args.attn_variants.split(",")
    tokens = [int(x) for x in args.attn_tokens.split(",")]
    for variant in variants:  # reject a bad entry before any timing
        _attend_fn(variant)
    _check_shapes(variants, args.slots, tokens, args.ctx, args.fill, hk, g, d)
    bw = copy_bandwidth(args.bandwidth_gib)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s; {args.preset}: {hk} kv heads x {g} query heads x "
          f"head dim {d}; ctx {args.ctx}, fill {args.fill}", flush=True)
    rows = []
    for b in args.slots:
        for t in tokens:
            inputs = _inputs(jax.random.key(b * 100 + t), b, t, args.ctx, args.fill, hk, g, d, args.attn_iters)
            # the filled K and V read, the query read and the output written
            floor_us = (2 * b * hk * (args.fill + t) * d * 2 + 2 * b * t * hk * g * d * 2) / bw * 1e6
            want = None
            for variant in variants:
                f = _chained(_attend_fn(variant))
                out = np.asarray(jax.block_until_ready(f(*inputs)), np.float32)  # compile + warm-up
                if want is None:
                    want = out
                diff = max_rel_diff(out, want)
                us = median_seconds(f, inputs, args.steps) / args.attn_iters * 1e6
                rows.append({"slots": b, "tokens": t, "variant": variant, "us_per_call": us, "floor_us": floor_us,
                             "floor_fraction": floor_us / us, "max_rel_diff": diff})
                print(f"  slots {b:3d} T {t:2d}: {variant:14s} {us:8.1f} us/call  floor {floor_us:6.1f} us  "
                      f"({floor_us / us:5.1%})  diff vs {variants[0]} {diff:.1e}", flush=True)
            del inputs  # free this shape's caches before the next one's are made
    return rows


def print_attention_table(rows: list[dict]) -> None:
    """The rows as a markdown table, each time also as a speed-up over the jnp form at the same (slots, tokens)."""
    print_variant_table(rows, ("slots", "tokens"), "us_per_call", "us/call", "max_rel_diff", "max rel diff")
