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
same run.

With `--attn-prefill-fills` the mode measures a prefill chunk's attention instead (`run_prefill_attention`): one
slot per `--slots` entry holding F tokens before a chunk of T (`--attn-chunks`) in a cache of `--ctx` positions (at
least F + T), at the preset's head shapes, per form: `jnp` (the blocked loop of pallas_kernels.prefill_attention),
`pallas` (the flash-style kernel of pallas_kernels.flash_prefill with its default tiling), `m<M>_k<K>_w<W>_s<S>`
(the kernel with M query rows and K keys per block, W warps, S pipeline stages), `cudnn` (jax.nn.dot_product_attention,
pallas_kernels.prefill_cudnn; with `--attn-qsa` the selection as its mask), `selected` (with `--attn-qsa` only:
pallas_kernels.selected_flash, the kernel that reads only each token's selected keys; `sel_k<K>_w<W>_s<S>` with K
gathered keys per step, W warps, S stages). `--attn-qsa` adds a random QSA selection of the preset's budget per
token. The floor is the causal attention's matmul FLOPs over the bf16 matmul rate measured in the run (with QSA
too: the masked forms compute every key block some token of theirs selects); with QSA the rows also give the
selection's own floor (each token's selected keys only), which only `selected` can approach."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.flash_prefill import PrefillBlocks, flash_prefill
from pallas_kernels.prefill_attention import prefill_attention
from pallas_kernels.prefill_cudnn import cudnn_prefill, cudnn_prefill_selected
from pallas_kernels.selected_flash import SelectedBlocks, selected_flash
from strata_jax.bench.common import matmul_rate, max_rel_diff, median_seconds, print_variant_table
from strata_jax.bench.floors import copy_bandwidth
from strata_jax.bench.synthetic import preset_config
from strata_jax.model.attention import chosen_from_ids

_VARIANT = re.compile(r"s(\d+)_k(\d+)_w(\d+)")


def attention_args(p) -> None:
    """Adds the attention-mode flags (--slots, --ctx, --fill, --preset, --steps and --bandwidth-gib are shared)."""
    p.add_argument("--attn-tokens", default="1,5", help="attention mode: comma-separated tokens per slot per call")
    p.add_argument("--attn-variants", default="jnp,pallas",
                   help="attention mode: jnp | pallas (the kernel's defaults) | s<splits>_k<block_k>_w<warps> (the "
                        "Pallas kernel with those settings), comma-separated")
    p.add_argument("--attn-iters", type=int, default=12, help="attention mode: calls per timed run, own cache each")
    p.add_argument("--attn-prefill-fills", default=None, metavar="F[,F...]",
                   help="attention mode: measure a prefill chunk's attention instead, over caches holding these many "
                        "tokens before the chunk (e.g. 2048,8192,20000,60000; default: decode attention)")
    p.add_argument("--attn-chunks", default="2048,4096", help="attention mode, prefill: tokens per chunk")
    p.add_argument("--attn-prefill-variants", default="jnp,pallas,cudnn",
                   help="attention mode, prefill: jnp | pallas | cudnn | m<rows>_k<keys>_w<warps>_s<stages> (the "
                        "kernel with that tiling) | selected | sel_k<keys>_w<warps>_s<stages> (with --attn-qsa: the "
                        "selected-keys kernel, default or with that tiling), comma-separated")
    p.add_argument("--attn-qsa", action="store_true",
                   help="attention mode, prefill: a random QSA block selection of about the preset's budget per "
                        "token (cudnn rows take it as their attention mask)")


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
    if args.attn_prefill_fills:
        return run_prefill_attention(args)
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


_TILING = re.compile(r"m(\d+)_k(\d+)_w(\d+)_s(\d+)")
_SEL_TILING = re.compile(r"sel_k(\d+)_w(\d+)_s(\d+)")


def _prefill_fn(variant: str, c: int):
    """variant -> f(q, k, v, start, sel, k_new, v_new) -> [B, T, Hk, G, D] (QSA blocks of c positions; ``sel``
    None or the selection as (chosen mask, block ids))."""
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run: the kernel's semantics, not its speed
    if variant == "jnp":
        return lambda q, k, v, st, sel, kn, vn: prefill_attention(q, k, v, st, None, sel and sel[0], c)
    if variant == "cudnn":  # with a QSA selection: the selection as cuDNN's mask
        return lambda q, k, v, st, sel, kn, vn: (cudnn_prefill(q, k, v, st, None, kn, vn) if sel is None
                                                 else cudnn_prefill_selected(q, k, v, st, None, sel[0], c))
    sel_match = _SEL_TILING.fullmatch(variant)
    if variant == "selected" or sel_match:  # QSA only: the kernel that reads each token's selected keys
        try:
            sel_blocks = SelectedBlocks(*(int(g) for g in sel_match.groups())) if sel_match else SelectedBlocks()
        except ValueError as e:
            raise SystemExit(f"bad --attn-prefill-variants entry {variant!r}: {e}") from e
        return lambda q, k, v, st, sel, kn, vn: selected_flash(q, k, v, st, sel[1], c, blocks=sel_blocks,
                                                               interpret=interpret)
    if variant == "pallas":
        blocks = None
    else:
        match = _TILING.fullmatch(variant)
        if match is None:
            raise SystemExit(f"bad --attn-prefill-variants entry {variant!r}: expected jnp, pallas, cudnn, selected "
                             "or m<rows>_k<keys>_w<warps>_s<stages>")
        try:
            blocks = PrefillBlocks(*(int(g) for g in match.groups()))
        except ValueError as e:
            raise SystemExit(f"bad --attn-prefill-variants entry {variant!r}: {e}") from e
    return lambda q, k, v, st, sel, kn, vn: flash_prefill(q, k, v, st, None, sel and sel[0], c, blocks=blocks,
                                                          interpret=interpret)


def prefill_attention_flops(slots: int, fill: int, chunk: int, heads: int, head_dim: int) -> float:
    """The two matmuls of causal attention for a chunk of ``chunk`` tokens after ``fill`` cached ones: token t sees
    fill + t + 1 positions, 4 x head_dim FLOPs per query head and position."""
    return 4.0 * head_dim * heads * slots * (chunk * fill + chunk * (chunk + 1) / 2)


def selection_flops(slots: int, fill: int, chunk: int, heads: int, head_dim: int, budget: int) -> float:
    """The two matmuls of QSA attention for a chunk after ``fill`` cached tokens: token t sees at most ``budget``
    selected positions plus its incomplete tail block (counted within the budget here), 4 x head_dim FLOPs per query
    head and position."""
    seen = np.minimum(fill + np.arange(chunk) + 1, budget)
    return 4.0 * head_dim * heads * slots * float(seen.sum())


def _prefill_inputs(key, b: int, t: int, ctx: int, fill: int, hk: int, g: int, d: int, iters: int, qsa_top: int,
                    c: int):
    """(q, [k], [v], start, selection or None, [k_new], [v_new]): random bf16 caches (beyond the filled part too),
    the chunk's own keys and values cut from each cache, and with ``qsa_top`` a random selection of that many
    complete QSA blocks (of c positions) per token (all when fewer are complete), as the mask ``chosen`` and as the
    block ids the indexer returns (`top_block_ids`: chosen blocks first, then ctx // c)."""
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, hk, g, d), jnp.bfloat16)
    ks = [jax.random.normal(jax.random.fold_in(kk, i), (b, hk, ctx, d), jnp.bfloat16) for i in range(iters)]
    vs = [jax.random.normal(jax.random.fold_in(kv, i), (b, hk, ctx, d), jnp.bfloat16) for i in range(iters)]
    own = [jnp.transpose(x[:, :, fill:fill + t], (0, 2, 1, 3)) for x in ks + vs]
    selection = None
    if qsa_top:
        nb = ctx // c
        complete = (fill + jnp.arange(t) + 1) // c  # complete blocks per token
        scores = jnp.where(jnp.arange(nb)[None, None, :] < complete[None, :, None],
                           jax.random.uniform(kc, (b, t, nb)), -1.0)
        vals, ids = jax.lax.top_k(scores, qsa_top)
        ids = jnp.where(vals >= 0, ids, nb).astype(jnp.int32)
        selection = (chosen_from_ids(ids, nb), ids)
    return q, ks, vs, jnp.full((b,), fill, jnp.int32), selection, own[:iters], own[iters:]


def _chained_prefill(attend):
    """As `_chained`, for the prefill forms."""
    def run(q, ks, vs, start, selection, kns, vns):
        out = q
        for k, v, kn, vn in zip(ks, vs, kns, vns):
            out = attend(q, k, v, start, selection, kn, vn)
            q = (q + out * 1e-3).astype(q.dtype)
        return out
    return jax.jit(run)


def run_prefill_attention(args) -> list[dict]:
    """Median time per call of each prefill form per (slots, fill, chunk), against the causal matmul floor, and its
    largest difference from the first form's output."""
    cfg = preset_config(args.preset)
    hk, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hk
    fills = [int(x) for x in args.attn_prefill_fills.split(",")]
    chunks = [int(x) for x in args.attn_chunks.split(",")]
    variants = args.attn_prefill_variants.split(",")
    c = cfg.indexer_compress_ratio if cfg.qsa else 1
    fns = {v: _prefill_fn(v, c) for v in variants}
    need = max(fills) + max(chunks)
    ctx = -(-max(args.ctx or 0, need) // 1024) * 1024
    qsa_top = cfg.indexer_budget // c if args.attn_qsa else 0
    if args.attn_qsa and not qsa_top:
        raise SystemExit(f"--attn-qsa: the preset {args.preset} has no QSA indexer")
    if not qsa_top and any(v == "selected" or _SEL_TILING.fullmatch(v) for v in variants):
        raise SystemExit("--attn-prefill-variants: selected forms read a QSA selection; add --attn-qsa")
    rate = matmul_rate()
    print(f"bf16 matmul rate: {rate / 1e12:.0f} TFLOP/s; {args.preset}: {hk} kv heads x {g} query heads x head dim "
          f"{d}; cache of {ctx} positions{'; QSA selection' if qsa_top else ''}", flush=True)
    rows = []
    for b in args.slots:
        for fill in fills:
            for t in chunks:
                inputs = _prefill_inputs(jax.random.key(fill + t), b, t, ctx, fill, hk, g, d, args.attn_iters,
                                         qsa_top, c)
                floor_us = prefill_attention_flops(b, fill, t, hk * g, d) / rate * 1e6
                sel_floor_us = (selection_flops(b, fill, t, hk * g, d, qsa_top * c) / rate * 1e6 if qsa_top
                                else floor_us)
                want = None
                for variant in variants:
                    f = _chained_prefill(fns[variant])
                    try:
                        out = np.asarray(jax.block_until_ready(f(*inputs)), np.float32)  # compile + warm-up
                    except Exception as e:  # noqa: BLE001 - one form refused (cuDNN's shape limits): go on
                        print(f"  slots {b} fill {fill:6d} chunk {t:5d}: {variant:16s} failed: "
                              f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    if want is None:
                        want = out
                    diff = max_rel_diff(out, want)
                    us = median_seconds(f, inputs, args.steps) / args.attn_iters * 1e6
                    rows.append({"slots": b, "fill": fill, "chunk": t, "qsa": bool(qsa_top), "variant": variant,
                                 "us_per_call": us, "floor_us": floor_us, "floor_fraction": floor_us / us,
                                 "selection_floor_us": sel_floor_us, "max_rel_diff": diff})
                    sel_note = f", selection's {sel_floor_us:7.1f} us ({sel_floor_us / us:5.1%})" if qsa_top else ""
                    print(f"  slots {b} fill {fill:6d} chunk {t:5d}: {variant:16s} {us:10.1f} us/call  floor "
                          f"{floor_us:9.1f} us ({floor_us / us:5.1%}){sel_note}  diff vs {variants[0]} {diff:.1e}",
                          flush=True)
                del inputs
    return rows


def print_attention_table(rows: list[dict]) -> None:
    """The rows as a markdown table, each time also as a speed-up over the jnp form at the same (slots, tokens), or
    (slots, fill, chunk) for prefill rows."""
    keys = ("slots", "fill", "chunk") if rows and "fill" in rows[0] else ("slots", "tokens")
    print_variant_table(rows, keys, "us_per_call", "us/call", "max_rel_diff", "max rel diff")
