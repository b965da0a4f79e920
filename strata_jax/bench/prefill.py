"""`python -m strata_jax.bench --mode prefill`: time to first token and prompt tok/s by prompt length, on one slot
of a context allocated the way a server allocates it, against the compute floor measured in the same run.

One engine (1 slot, `--ctx`, `--prefill-chunks`) serves one greedy request per length of `--prompt-lengths` (each
length twice; the second is timed, so nothing is compiled or paged in during it; the prefix cache is on, as
served, but every prompt is new). The floor
is the prompt's matmul work (`prefill_flops`: every weight a token passes through, attention over what it sees)
over the bf16 matmul rate measured on the device (`matmul_rate`).

`--deltanet-forms` runs the lengths once per form of the Gated DeltaNet chunks, one engine each on the same weights:
`<scan>[+<precision>][+ut<N>]` as in `--mode deltanet` (the scan over chunks as a loop, `jnp`, the states loop,
`states`, a parallel prefix, `assoc`, or the Pallas kernel with its settings, `pallas_bv64_w8_tf32x3`; the UT system's
matmul precision; its inverse's blocks; `+prep`: the per-chunk part as one Pallas kernel), so an A/B of the forms
shares one process and one model. `--auto-selected on,off` crosses them with the attention layers' choice for
chunks with a QSA selection (`flash_prefill.AUTO_SELECTED` while tracing: the selected-keys kernel, or cuDNN with
the selection as its mask), under `--prefill-attention auto`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from pallas_kernels import flash_prefill
from strata_jax.bench.common import matmul_rate
from strata_jax.bench.deltanet import PREP_PRECISIONS, module_constants, parse_form, prep_kernel, scan_kernel
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.model import deltanet
from strata_jax.model.config import ModelConfig


def prefill_args(p: argparse.ArgumentParser) -> None:
    """The prefill mode's flags (it also uses --preset/--model-dir, --ctx, --prefill-chunks and --dtype)."""
    g = p.add_argument_group("prefill mode")
    g.add_argument("--prompt-lengths", default="2048,8192,20000,60000",
                   type=lambda v: tuple(int(x) for x in v.split(",")),
                   help="prompt lengths to time (default 2048,8192,20000,60000)")
    g.add_argument("--prefix-cache-mib", type=int, default=2048,
                   help="the engine's prefix cache (default 2048, as served: its snapshots are part of prefill's "
                        "cost; every prompt here is new, so nothing is reused; 0 = off)")
    g.add_argument("--deltanet-forms", default="auto",
                   help="comma-separated forms of the Gated DeltaNet chunks, one engine each: auto (the engine's "
                        "choice) or <jnp|states|assoc|pallas[_bv<N>][_w<W>][_s<S>][_<dot precision>]>[+<"
                        + "|".join(PREP_PRECISIONS) + ">][+ut<N>] (the scan over chunks, as in --mode deltanet; the "
                        "UT system's precision; its inverse in blocks of N tokens, ut0: doubling over the chunk; "
                        "+prep[_w<W>][_<dot precision>]: the per-chunk part as one Pallas kernel; default auto)")
    g.add_argument("--auto-selected", default=None, metavar="on|off[,...]",
                   help="comma-separated settings of the attention's \"auto\" choice for QSA chunks on a GPU, one "
                        "engine each per --deltanet-forms entry: on (the selected-keys kernel), off (cuDNN with the "
                        "selection as its mask); default: the engine's own")


@contextlib.contextmanager
def deltanet_form(form: str):
    """While inside, models traced use this form of the Gated DeltaNet chunks ("auto": leave the defaults)."""
    if form == "auto":
        yield
        return
    scan, precision, block, prep = parse_form(form, ("jnp", "assoc", "states", "pallas"), "--deltanet-forms")
    saved = deltanet.SCAN_IMPL, deltanet.PREP_PRECISION, deltanet.UT_BLOCK, deltanet.PREP_IMPL
    with scan_kernel(scan) as impl, prep_kernel(prep) as prep_impl:
        deltanet.SCAN_IMPL, deltanet.PREP_PRECISION, deltanet.PREP_IMPL = impl, precision, prep_impl
        if block is not None:
            deltanet.UT_BLOCK = block
        try:
            yield
        finally:
            deltanet.SCAN_IMPL, deltanet.PREP_PRECISION, deltanet.UT_BLOCK, deltanet.PREP_IMPL = saved


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> dict[str, float]:
    """The matmul FLOPs of prefilling `n_tokens` from position 0, by part: the weights every token passes through
    (projections, router, the routed experts it picks, the shared expert), attention scores and values over the
    positions it sees (QSA: at most the indexer's budget), the Gated DeltaNet recurrence (state-sized work per token)
    and the output head once (only the last position's logits are needed)."""
    h, n = cfg.hidden_size, n_tokens
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    n_gdn = cfg.num_layers - n_attn
    attn_w = h * cfg.num_heads * cfg.head_dim * 2 + 2 * h * cfg.num_kv_heads * cfg.head_dim \
        + cfg.num_heads * cfg.head_dim * h
    if cfg.qsa:
        attn_w += h * (cfg.indexer_n_heads + 1) * cfg.indexer_head_dim
    nk, nv, dk, dv = cfg.linear_num_k_heads, cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    gdn_w = h * (2 * nk * dk + nv * dv) + h * nv * dv + 2 * h * nv + nv * dv * h
    moe_w = h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size \
        + 3 * h * cfg.shared_expert_intermediate_size
    # Each position sees the positions before it; QSA caps what it reads at the budget (plus its block's tail).
    cap = cfg.indexer_budget + cfg.indexer_compress_ratio if cfg.qsa else n
    seen = sum(min(p + 1, cap) for p in range(0, n, 64)) * 64 if n > 64 else n * (n + 1) / 2
    return {
        "weights": 2.0 * n * (n_attn * attn_w + n_gdn * gdn_w + cfg.num_layers * moe_w),
        "attention": 2.0 * 2 * n_attn * cfg.num_heads * cfg.head_dim * seen,
        "deltanet": 2.0 * 3 * n * n_gdn * nv * dk * dv,
        "head": 2.0 * h * cfg.vocab_size,
    }


async def _first_token(engine: Engine, prompt: tuple[int, ...]) -> float:
    t0 = time.perf_counter()
    stream = await engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    async for _ in stream:
        pass
    return time.perf_counter() - t0


def run_prefill(args: argparse.Namespace, model) -> list[dict]:
    """Times the first token of each prompt length (see the module docstring) per `--deltanet-forms` entry;
    returns one row per (form, length)."""
    forms = getattr(args, "deltanet_forms", "auto").split(",")
    for form in forms:  # reject a bad entry before building anything
        with deltanet_form(form):
            pass
    switches = getattr(args, "auto_selected", None)
    settings = [None] if switches is None else [_on_off(x) for x in switches.split(",")]
    rate = matmul_rate()
    rows = []
    for form in forms:
        for setting in settings:
            with deltanet_form(form), auto_selected(setting):
                for row in _run_form(args, model, rate, form):
                    rows.append({**row, "auto_selected": flash_prefill.AUTO_SELECTED})
    return rows


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise SystemExit(f"--auto-selected entries are on or off, got {text!r}")
    return text == "on"


def auto_selected(setting: bool | None):
    """While inside, models traced take (True) or skip (False) the selected-keys kernel for QSA chunks under
    "auto" (None: leave the default)."""
    return module_constants(flash_prefill, {"on": "AUTO_SELECTED"}, {} if setting is None else {"on": setting})


def _run_form(args: argparse.Namespace, model, rate: float, form: str) -> list[dict]:
    import numpy as np

    lengths = args.prompt_lengths
    ctx = args.ctx or max(lengths) + 64
    print(f"prefill: bf16 matmul rate {rate / 1e12:.0f} TFLOP/s; 1 slot x {ctx} tokens, chunks "
          f"{args.prefill_chunks}; deltanet form {form}; QSA chunks under auto: "
          f"{'selected-keys kernel' if flash_prefill.AUTO_SELECTED else 'cuDNN / jnp'}", flush=True)
    engine = Engine(model, EngineConfig(slots=1, max_context=ctx, prefill_chunks=args.prefill_chunks,
                                        prefix_cache_mib=args.prefix_cache_mib, overlap_steps=False,
                                        cache_dtype=getattr(args, "cache_dtype", None)))
    engine.start()
    rows = []
    rng = np.random.default_rng(0)
    try:
        for n in lengths:
            timings = []
            for _ in range(2):  # a different prompt each time: nothing can be reused
                prompt = tuple(int(t) for t in rng.integers(0, model.config.vocab_size, n))
                timings.append(asyncio.run(_first_token(engine, prompt)))
            flops = prefill_flops(model.config, n)
            floor_s = sum(flops.values()) / rate
            ttft = timings[-1]
            row = {"deltanet_form": form, "prompt_tokens": n, "ctx": ctx, "chunks": list(args.prefill_chunks),
                   "ttft_s": ttft, "first_ttft_s": timings[0], "prompt_tok_s": n / ttft, "floor_s": floor_s,
                   "fraction_of_floor": floor_s / ttft, "gflop_per_token": sum(flops.values()) / n / 1e9,
                   "tflops": rate / 1e12}
            rows.append(row)
            print(f"prefill {n} tokens ({form}, QSA selected-keys {flash_prefill.AUTO_SELECTED}): "
                  f"TTFT {ttft:.3f} s ({n / ttft:,.0f} prompt tok/s); floor "
                  f"{floor_s:.3f} s ({row['gflop_per_token']:.1f} GFLOP/token), {row['fraction_of_floor']:.0%} of it",
                  flush=True)
    finally:
        engine.shutdown()
    return rows


def print_prefill_table(rows: list[dict]) -> None:
    """The rows as a markdown table."""
    print("\n| deltanet form | QSA chunks | prompt tokens | ctx | TTFT s | prompt tok/s | compute floor s | "
          "fraction of floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        qsa = "selected keys" if r.get("auto_selected") else "masked"
        print(f"| {r.get('deltanet_form', 'auto')} | {qsa} | {r['prompt_tokens']:,} | {r['ctx']:,} | "
              f"{r['ttft_s']:.3f} | {r['prompt_tok_s']:,.0f} | {r['floor_s']:.3f} | {r['fraction_of_floor']:.0%} |")
