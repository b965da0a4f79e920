"""`python -m strata_jax.bench --mode deltanet`: one Gated DeltaNet layer's recurrence for a few tokens per slot
(decode: 1, speculative verify: draft-k+1) at a preset's head shapes, per implementation.

The input is the layer's activated conv output (bf16), as in the engine. The floor is the float32 state read once and
written once, over the copy bandwidth measured in the same run. The jnp form (split, normalise, scan; what runs
off-GPU) is the baseline; `bv<N>_w<W>` is the Pallas kernel with column blocks of N and W warps.
A layer runs `--deltanet-iters` times inside one jitted loop (the state carried, as a donated cache would be) so
the launch of the timing call does not count.

With `--deltanet-prefill-tokens`, also the chunked rule of a prefill chunk (`strata_jax.model.deltanet
.chunk_gated_delta_rule`: the UT system per 64-token chunk, then the recurrence over chunks) per variant
`<scan>[+<precision>][+ut<N>][+prep...]`: the scan as a loop over chunks (`jnp`), a loop of the state's path alone
with the outputs after it (`states`), a parallel prefix (`assoc`) or the Pallas kernel (`pallas`, with its column
block, warps, pipeline stages and dot precision as `pallas_bv64_w8_s2_tf32x3`; `delta_chunk`'s defaults otherwise);
the UT system's matmuls at `highest` (the default), `x6` / `x3` (six or three bf16 passes), `tf32` or `default`; its
inverse in diagonal blocks of N tokens (`ut16`) or by doubling over the whole chunk (`ut0`), without it the model's
default (`deltanet.UT_BLOCK`); `+prep[_w<W>][_<dot precision>]` runs the per-chunk part as one Pallas kernel
(`pallas_kernels.delta_prep`; the UT precision and blocks then do not apply). Its error is against the loop with
every matmul in full float32 and the inverse doubled; its floor is the rule's float32 inputs read and outputs
written once."""

from __future__ import annotations

import contextlib
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import delta_chunk, delta_prep, delta_rule
from strata_jax.model.deltanet import chunk_gated_delta_rule
from strata_jax.bench.common import max_rel_diff, print_variant_table
from strata_jax.bench.floors import copy_bandwidth
from strata_jax.bench.synthetic import preset_config

_VARIANT = re.compile(r"bv(\d+)_w(\d+)")
PREP_PRECISIONS = {
    "highest": jax.lax.Precision.HIGHEST,
    "default": jax.lax.Precision.DEFAULT,
    "x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
}


def deltanet_args(p) -> None:
    """Adds the deltanet-mode flags (--slots, --preset, --steps and --bandwidth-gib are shared)."""
    p.add_argument("--deltanet-tokens", default="1,4", help="deltanet mode: comma-separated tokens per slot")
    p.add_argument("--deltanet-variants", default="jnp,bv16_w4,bv32_w4,bv32_w8,bv64_w8",
                   help="deltanet mode: jnp | bv<block_v>_w<warps> (the Pallas kernel), comma-separated")
    p.add_argument("--deltanet-iters", type=int, default=20, help="deltanet mode: layers per timed call")
    p.add_argument("--deltanet-prefill-tokens", default="",
                   help="deltanet mode: comma-separated prompt-chunk lengths for the chunked rule (default: none)")
    p.add_argument("--deltanet-prefill-variants", default="jnp,assoc,assoc+x6",
                   help="deltanet mode: <scan>[+<precision>][+ut<N>][+prep[_w<W>][_<dot precision>]] per "
                        "chunked-rule row; scan jnp | states | assoc | pallas[_bv<N>][_w<W>][_s<S>][_<dot precision>] "
                        f"(the kernel's column block, warps, stages and {' | '.join(delta_chunk.KERNEL_PRECISIONS)}"
                        f"), precision of the UT system {' | '.join(PREP_PRECISIONS)} (default highest), its inverse "
                        "in blocks of N tokens (ut0: doubling over the chunk; default: the model's), prep: the "
                        "per-chunk part as one Pallas kernel")


def _rule(variant: str, k_heads: int):
    if variant == "jnp":
        return lambda *a: delta_rule.gated_delta_decode(*a, k_heads=k_heads, impl="jnp")
    match = _VARIANT.fullmatch(variant)
    if match is None:
        raise SystemExit(f"bad --deltanet-variants entry {variant!r}: expected jnp or bv<N>_w<W>")
    bv, warps = int(match[1]), int(match[2])
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run: the kernel's semantics, not its speed
    return lambda *a: delta_rule.gated_delta_decode(*a, k_heads=k_heads, impl="pallas", block_v=bv, num_warps=warps,
                                                    interpret=interpret)


def _inputs(key, slots: int, t: int, hk: int, hv: int, dk: int, dv: int):
    kx, kg, kb, ks = jax.random.split(key, 4)
    qkv = jax.random.normal(kx, (slots, t, 2 * hk * dk + hv * dv), jnp.bfloat16)
    g = -jax.random.uniform(kg, (slots, t, hv), minval=0.01, maxval=0.5)
    beta = jax.random.uniform(kb, (slots, t, hv))
    return qkv, g, beta, jax.random.normal(ks, (slots, hv, dk, dv))


def _looped(rule, iters: int, n_inputs: int):
    """`rule(*inputs, state) -> (out [B, T, H, Dv], state)` run `iters` times in one jitted loop, the state carried
    and donated (`n_inputs` inputs before it, the last of them beta [B, T, H])."""
    def run(*args):
        *inputs, state = args

        def body(_, carry):
            state, acc = carry
            out, state = rule(*inputs, state)
            return state, acc + out[:, -1, :, 0]
        return jax.lax.fori_loop(0, iters, body, (state, jnp.zeros(inputs[-1].shape[::2], jnp.float32)))
    return jax.jit(run, donate_argnums=n_inputs)


def _us_per_layer(rule, inputs: tuple, state, iters: int, steps: int) -> float:
    """Median microseconds per layer of `rule` in `_looped` (compiled and warmed up first)."""
    f = _looped(rule, iters, len(inputs))
    state, _ = f(*inputs, state + 0.0)  # compile + warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, acc = f(*inputs, state)
        acc.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / iters * 1e6


_UT = re.compile(r"ut(\d+)")
_KERNEL_PART = re.compile(r"(bv|w|s)(\d+)")


def kernel_settings(scan: str) -> dict | None:
    """`pallas[_bv<N>][_w<W>][_s<S>][_<precision>]` -> the scan kernel's settings for `delta_chunk.chunk_scan`
    (block_v, num_warps, num_stages, precision; the module's defaults where not named); None if malformed."""
    name, *parts = scan.split("_")
    if name != "pallas":
        return None
    settings = {}
    for part in parts:
        m = _KERNEL_PART.fullmatch(part)
        key = {"bv": "block_v", "w": "num_warps", "s": "num_stages"}[m[1]] if m else "precision"
        if key in settings or (not m and part not in delta_chunk.KERNEL_PRECISIONS):
            return None
        settings[key] = int(m[2]) if m else part
    return settings


def parse_form(form: str, scans: tuple[str, ...], flag: str) -> tuple[str, object, int | None, dict | None]:
    """`<scan>[+<precision>][+ut<N>][+prep[_w<W>][_<dot precision>]]` -> (scan, the UT system's precision, its
    inverse's block or None for the model's default, the prep kernel's settings or None for the XLA prep); where
    `scans` has "pallas", the scan may carry the kernel's settings (`kernel_settings`). A bad entry exits naming
    `flag`."""
    scan, *rest = form.split("+")
    precision, block, prep = "highest", None, None
    for part in rest:
        if part in PREP_PRECISIONS and precision == "highest":
            precision = part
        elif (m := _UT.fullmatch(part)) and block is None:
            block = int(m[1])
        elif part.split("_")[0] == "prep" and prep is None and "pallas" in scans:
            prep = kernel_settings(part.replace("prep", "pallas", 1))
            if prep is None or {"block_v", "num_stages"} & set(prep):
                scan = None
        else:
            scan = None
    known = scan in scans or ("pallas" in scans and kernel_settings(scan or "") is not None)
    if not known:
        kernel = "|pallas[_bv<N>][_w<W>][_s<S>][_<" + "|".join(delta_chunk.KERNEL_PRECISIONS) + ">]"
        prep_form = "[+prep[_w<W>][_<dot precision>]]" if "pallas" in scans else ""
        raise SystemExit(f"bad {flag} entry {form!r}: expected <{'|'.join(s for s in scans if s != 'pallas')}"
                         f"{kernel if 'pallas' in scans else ''}>[+<{'|'.join(PREP_PRECISIONS)}>][+ut<N>]{prep_form}")
    return scan, PREP_PRECISIONS[precision], block, prep


@contextlib.contextmanager
def module_constants(module, names: dict[str, str], settings: dict):
    """While inside, `module`'s constants named by `names` (setting -> constant) hold `settings`' values."""
    saved = {names[k]: getattr(module, names[k]) for k in settings}
    for key, value in settings.items():
        setattr(module, names[key], value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def prep_kernel(settings: dict | None):
    """While inside, the per-chunk part runs as the Pallas kernel with `settings` (num_warps, precision; the
    module's defaults where not named); yields the `prep_impl` for `chunk_gated_delta_rule` ("jnp" for None)."""
    if settings is None:
        yield "jnp"
        return
    with module_constants(delta_prep, {"num_warps": "NUM_WARPS", "precision": "PRECISION"}, settings):
        yield "pallas"


@contextlib.contextmanager
def scan_kernel(scan: str):
    """While inside, the scan kernel runs with the settings `scan` names (`kernel_settings`); yields the impl name
    for `chunk_scan` ("pallas" for any kernel form, else `scan` itself)."""
    settings = kernel_settings(scan)
    if settings is None:
        yield scan
        return
    names = {"block_v": "BLOCK_V", "num_warps": "NUM_WARPS", "num_stages": "NUM_STAGES",
             "precision": "KERNEL_PRECISION"}
    with module_constants(delta_chunk, names, settings):
        yield "pallas"


def _chunked(variant: str):
    scan, prec, block, prep = parse_form(variant, ("jnp", "assoc", "states", "pallas"),
                                         "--deltanet-prefill-variants")

    def rule(*a):
        with scan_kernel(scan) as impl, prep_kernel(prep) as prep_impl:  # the settings are read while tracing
            return chunk_gated_delta_rule(*a, scan_impl=impl, precision=prec, ut_block=block, prep_impl=prep_impl)
    return rule


def _prefill_inputs(key, slots: int, t: int, h: int, dk: int, dv: int):
    kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(kq, (slots, t, h, dk))) * dk**-0.5
    k = unit(jax.random.normal(kk, (slots, t, h, dk)))
    v = jax.random.normal(kv, (slots, t, h, dv))
    g = -jax.random.uniform(kg, (slots, t, h), minval=0.01, maxval=0.5)
    beta = jax.random.uniform(kb, (slots, t, h))
    return q, k, v, g, beta, jax.random.normal(ks, (slots, h, dk, dv))


def run_deltanet_prefill(args, bw: float) -> list[dict]:
    """Median time per layer of the chunked rule per variant, and its error against the float32 loop, per (slots,
    prompt-chunk length)."""
    cfg = preset_config(args.preset)
    variants = args.deltanet_prefill_variants.split(",")
    for variant in variants:
        _chunked(variant)
    h, dk, dv = cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    rows = []
    for slots in args.slots:
        for t in (int(x) for x in args.deltanet_prefill_tokens.split(",")):
            inputs = _prefill_inputs(jax.random.key(slots * 7 + t), slots, t, h, dk, dv)
            floor_us = slots * t * h * (2 * dk + 2 * dv + 2) * 4 / (bw / 2) * 1e6  # read once + write once
            with jax.default_matmul_precision("highest"):
                want = [np.asarray(x) for x in jax.jit(_chunked("jnp+ut0"))(*inputs)]
            for variant in variants:
                got = jax.jit(_chunked(variant))(*inputs)
                err = max(max_rel_diff(np.asarray(g), w) for g, w in zip(got, want))
                us = _us_per_layer(_chunked(variant), inputs[:5], inputs[5], args.deltanet_iters, args.steps)
                rows.append({"slots": slots, "tokens": t, "variant": variant, "us_per_layer": us,
                             "floor_us": floor_us, "floor_fraction": floor_us / us, "max_rel_err": err})
                print(f"  slots {slots:3d} T {t}: {variant:12s} {us:9.1f} us/layer  floor {floor_us:7.1f} us  "
                      f"({floor_us / us:5.1%})  err {err:.1e}", flush=True)
    return rows


def run_deltanet(args) -> list[dict]:
    """Median time per layer of each variant, and its error against the jnp scan, per (slots, tokens); then the
    chunked rule's rows (`run_deltanet_prefill`) when `--deltanet-prefill-tokens` is given."""
    cfg = preset_config(args.preset)
    variants = args.deltanet_variants.split(",")
    for variant in variants:  # reject a bad entry before any timing
        _rule(variant, 1)
    for variant in args.deltanet_prefill_variants.split(",") if args.deltanet_prefill_tokens else ():
        _chunked(variant)
    hk, h, dk, dv = cfg.linear_num_k_heads, cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    bw = copy_bandwidth(args.bandwidth_gib)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s; {args.preset}: {h} heads x [{dk}, {dv}] state",
          flush=True)
    rows = []
    for slots in args.slots:
        for t in (int(x) for x in args.deltanet_tokens.split(",") if x):
            inputs = _inputs(jax.random.key(slots * 100 + t), slots, t, hk, h, dk, dv)
            floor_us = 2 * slots * h * dk * dv * 4 / bw * 1e6
            want = None
            for variant in variants:
                out, state = jax.jit(_rule(variant, hk))(*inputs)
                if want is None:
                    want = np.asarray(out), np.asarray(state)
                err = max(float(np.max(np.abs(np.asarray(out) - want[0]))),
                          float(np.max(np.abs(np.asarray(state) - want[1]))))
                us = _us_per_layer(_rule(variant, hk), inputs[:3], inputs[3], args.deltanet_iters, args.steps)
                rows.append({"slots": slots, "tokens": t, "variant": variant, "us_per_layer": us,
                             "floor_us": floor_us, "floor_fraction": floor_us / us, "max_abs_err": err})
                print(f"  slots {slots:3d} T {t}: {variant:10s} {us:8.1f} us/layer  floor {floor_us:6.1f} us  "
                      f"({floor_us / us:5.1%})  err {err:.1e}", flush=True)
    if args.deltanet_prefill_tokens:
        rows += run_deltanet_prefill(args, bw)
    return rows


def print_deltanet_table(rows: list[dict]) -> None:
    """The decode rows' table, then the chunked rule's (prefill) rows' table."""
    decode = [r for r in rows if "max_abs_err" in r]
    prefill = [r for r in rows if "max_rel_err" in r]
    if decode:
        print_variant_table(decode, ("slots", "tokens"), "us_per_layer", "us/layer", "max_abs_err", "max abs err")
    if prefill:
        print_variant_table(prefill, ("slots", "tokens"), "us_per_layer", "us/layer", "max_rel_err",
                            "max rel err (vs float32 loop)")
