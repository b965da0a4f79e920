"""The seed system's scenario (`python -m strata_jax.bench --mode users`): N concurrent users each stream a coding
prompt through the engine; per-user decode tok/s, aggregate tok/s, time to first token p50/p95 and the drafter's
acceptance rate, with speculation off and on, beside the seed system's published figures (RTX 5090)."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.api import LoadedModel, load_model
from strata_jax.config import ExpertQuantization
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.floors import copy_bandwidth, step_bytes
from strata_jax.synthetic import preset_config, synthetic_model

# Strata, RTX 5090, 256K context (DESIGN.md): users -> (per-user tok/s, aggregate tok/s, TTFT).
SEED = {1: (144.0, 144.0, "< 2 s"), 4: (38.0, 125.0, "2-8 s"), 8: (19.0, 130.0, "2-8 s")}

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
    """The checkpoint given by --model, or a synthetic model at --preset shapes (no tokenizer)."""
    if args.model_dir:
        quant = {"quantize": "1bit", "planes": args.planes, "group": args.group} if args.planes else {}
        return load_model(args.model_dir, dtype=args.dtype, **quant)
    cfg = preset_config(args.preset)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    quant = ExpertQuantization(planes=args.planes or 1, group=args.group, impl=args.impl)
    model = synthetic_model(cfg, dtype, quant)
    return LoadedModel(Path(f"synthetic:{args.preset}"), cfg, model, dtype, [], None)


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
    first, count, last = None, 0, None
    async for ev in stream:
        if ev.token_id is not None:
            count += 1
            first = first or time.perf_counter()
        last = ev
    end = time.perf_counter()
    return {
        "ttft": first - started,
        "decode_tok_s": (count - 1) / (end - first) if count > 1 else 0.0,
        "tokens": count,
        "drafted": last.draft_tokens,
        "accepted": last.accepted_draft_tokens,
    }


def run_users(args) -> list[dict]:
    model = bench_model(args)
    ctx = args.prompt_tokens + args.gen_tokens + 16
    bandwidth = copy_bandwidth(args.bandwidth_gib)
    net = nnx.merge(model.graphdef, model.state)
    rows = []
    drafts = ["none"] if args.draft == "none" else ["none", args.draft]
    for draft in drafts:
        for users in args.users:
            config = EngineConfig(slots=users, max_context=ctx, prefill_chunks=(64, 256), prefix_cache_mib=0,
                                  draft=draft, draft_k=args.draft_k)
            engine = Engine(model, config)
            engine.start()
            try:
                prompts = user_prompts(model, users, args.prompt_tokens)

                async def all_users():
                    return await asyncio.gather(*[_one(engine, p, args.gen_tokens) for p in prompts])

                started = time.perf_counter()
                results = asyncio.run(all_users())
                wall = time.perf_counter() - started
            finally:
                engine.shutdown()
            ttfts = sorted(r["ttft"] for r in results)
            # The floor of one decode step at this many slots, half-way through the answers.
            floor_ms = sum(step_bytes(model.config, net, users, args.prompt_tokens + args.gen_tokens // 2).values())
            floor_ms = floor_ms / bandwidth * 1e3
            drafted = sum(r["drafted"] for r in results)
            row = {
                "users": users, "speculation": draft,
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
            }
            rows.append(row)
            print(f"users {users}, speculation {draft}: {row['per_user_tok_s']:.1f} tok/s per user, "
                  f"{row['aggregate_tok_s']:.1f} aggregate, TTFT p50 {row['ttft_p50_s']:.2f} s", flush=True)
    return rows


def print_users_table(rows: list[dict]) -> None:
    print("\n| users | speculation | tok/s per user (seed) | aggregate tok/s (seed) | TTFT p50 / p95 s (seed) "
          "| acceptance | step floor ms | floor / time per token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        seed_u = "-" if r["seed_per_user_tok_s"] is None else f"{r['seed_per_user_tok_s']:.0f}"
        seed_a = "-" if r["seed_aggregate_tok_s"] is None else f"{r['seed_aggregate_tok_s']:.0f}"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"| {r['users']} | {r['speculation']} | {r['per_user_tok_s']:.1f} ({seed_u}) "
              f"| {r['aggregate_tok_s']:.1f} ({seed_a}) | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} "
              f"({r['seed_ttft'] or '-'}) | {acc} | {r['step_floor_ms']:.3f} | {r['fraction_of_floor']:.0%} |")


def users_args(p) -> None:
    """Adds the users-scenario flags to the bench's parser."""
    p.add_argument("--model-dir", default=None,
                   help="checkpoint for --mode users (default: the synthetic --preset model)")
    p.add_argument("--users", default="1,4,8", help="comma-separated concurrent user counts (default 1,4,8)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens per user")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per user")
    p.add_argument("--draft", default="ngram", choices=["none", "ngram", "mtp"],
                   help="drafter for the speculation-on rows (default ngram)")
    p.add_argument("--draft-k", type=int, default=4, help="tokens drafted per step")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
