"""Command line: `python -m strata_jax generate|serve|quantize|plan|bench ...` (installed as `strata-jax`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from strata_jax.compile_cache import default_cache_dir
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine.config import AGENT_CONTEXT, CPU_CONTEXT, MAX_DEFAULT_CONTEXT, EngineConfig
from strata_jax.model.config import HOST_MEMORIES, PREFILL_ATTENTION_IMPLS, STREAM_COPIES


def _generate(args: argparse.Namespace) -> int:
    import jax

    from strata_jax import load_model
    from strata_jax.engine.planner import default_dtype

    mesh = mesh_of(args)
    model = load_model(args.model, dtype=args.dtype or default_dtype(jax.default_backend()),
                       mesh=None if mesh is None else mesh.make(), expert_exchange=args.expert_exchange)
    tok = model.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.cache_dtype is None:
        out = model.generate(ids, args.max_tokens, temperature=args.temperature, seed=args.seed)
    else:
        out = generate_with_cache(model, ids, args.max_tokens, args.cache_dtype, temperature=args.temperature,
                                  seed=args.seed)
    elapsed = time.monotonic() - started
    print(answer_text(tok, out, set(model.config.eos_token_ids) | set(tok.eos_token_ids)))
    print(
        f"[{len(ids)} prompt tokens, {len(out)} generated in {elapsed:.2f}s "
        f"({len(out) / max(elapsed, 1e-9):.1f} tok/s incl. compile)]",
        file=sys.stderr,
    )
    return 0


def generate_with_cache(model, ids: list[int], max_new_tokens: int, cache_dtype: str, temperature: float = 0.0,
                        seed: int = 0) -> list[int]:
    """`LoadedModel.generate` (stopping after an eos token) on a cache of `cache_dtype` (EngineConfig.cache_dtype's
    names: bf16, float32, int8, fp8) instead of the model's dtype."""
    import jax.numpy as jnp
    import numpy as np

    from strata_jax.engine.config import EngineConfig
    from strata_jax.loaded_model import Sequences
    from strata_jax.model.cache import init_cache, kv_dtype_of

    name = EngineConfig(cache_dtype=cache_dtype).cache_dtype  # validated, bf16 -> bfloat16
    kv = kv_dtype_of(name)
    cache = init_cache(model.config, 1, len(ids) + max_new_tokens, model.dtype if kv is not None else jnp.dtype(name),
                       with_mtp=model.has_mtp, kv_dtype=kv)
    logits, _, seqs = model.step(Sequences(cache, model.ple_context([])), np.asarray([ids], np.int32))
    rng = np.random.default_rng(seed)
    eos = set(model.config.eos_token_ids) | (set(model.tokenizer.eos_token_ids) if model.tokenizer else set())
    out: list[int] = []
    for _ in range(max_new_tokens):
        z = logits[0, -1].astype(np.float64)
        if temperature <= 0:
            token = int(np.argmax(z))
        else:
            p = np.exp((z - z.max()) / temperature)
            token = int(rng.choice(len(p), p=p / p.sum()))
        out.append(token)
        if token in eos:
            break
        logits, _, seqs = model.step(seqs, np.asarray([[token]], np.int32))
    return out


def answer_text(tok, out: list[int], eos_ids: set[int]) -> str:
    """The text of generated ids without the end-of-sequence / end-of-turn token (`<|im_end|>`) that ended them.
    Other special tokens stay: `<think>` and `<tool_call>` are the answer's markup."""
    if out and out[-1] in eos_ids:
        out = out[:-1]
    return tok.decode(out)


def _quantize(args: argparse.Namespace) -> int:
    from strata_jax.weights.convert import convert_checkpoint, convert_from_gguf

    started = time.monotonic()
    if (args.model is None) == (args.from_gguf is None):
        raise ValueError("quantize needs exactly one of --model DIR and --from-gguf FILE")
    if args.from_gguf is not None:
        explicit = "--planes" in sys.argv or "--group" in sys.argv
        meta = convert_from_gguf(args.from_gguf, args.out, dtype=args.dtype, planes=args.planes if explicit else None,
                                 group=args.group if explicit else None)
        print(f"wrote {args.out} from {args.from_gguf} ({meta['planes']} plane(s), group {meta['group']}) in "
              f"{time.monotonic() - started:.1f}s")
        return 0
    meta = convert_checkpoint(args.model, args.out, group=args.group, planes=args.planes, dtype=args.dtype)
    print(f"wrote {args.out} ({meta['planes']} plane(s), group {meta['group']}) in {time.monotonic() - started:.1f}s")
    return 0


def _prefix_cache_mib(args: argparse.Namespace) -> int:
    """--prefix-cache-mib, or the budget planned from the host's memory (printed: agents depend on it)."""
    from strata_jax.engine.prefix_cache import planned_budget_mib

    mib = args.prefix_cache_mib if args.prefix_cache_mib is not None else planned_budget_mib()
    print(f"prefix cache: {mib:,} MiB of host memory for snapshots", flush=True)
    return mib


def _serve(args: argparse.Namespace) -> int:
    from server.main import EXIT_STUCK, serve

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    for flag, value, bound in (("--slots", args.slots, 1), ("--ctx", args.ctx, 2), ("--port", args.port, 0),
                               ("--prefill-batch", args.prefill_batch, 1),
                               ("--prefix-cache-mib", args.prefix_cache_mib, 0)):
        if value is not None and value < bound:
            print(f"error: {flag} must be >= {bound}", file=sys.stderr)
            return 2
    try:  # EngineConfig's own checks, before the model loads
        EngineConfig(decode_share=args.decode_share, mixed_step_ms=args.mixed_step_ms,
                     prefill_burst_ms=args.prefill_burst_ms, share_by_requests=args.share_by_requests)
    except ValueError:
        print("error: --decode-share must be in [0, 1), --mixed-step-ms and --prefill-burst-ms >= 0", file=sys.stderr)
        return 2
    draft, draft_dir = args.draft, None
    if draft not in ("none", "ngram", "mtp"):
        draft_dir, draft = Path(draft), "none"
        if not draft_dir.is_dir():
            raise FileNotFoundError(f"--draft {args.draft}: not none/ngram/mtp and not a checkpoint directory")
    _apply_card(args)
    if args.vram_budget_mib is not None and args.vram_budget_mib <= 0:
        print("error: --vram-budget-mib must be > 0", file=sys.stderr)
        return 2
    if args.ctx is not None:
        _check_context_fits_the_template(model_dir, args.ctx)
    setup = _serve_plan(args, model_dir)  # before JAX starts its backend: the allocator follows the plan
    gpu_experts, ctx, dtype = setup.gpu_experts, setup.ctx, setup.dtype
    served_name = args.served_name or model_dir.resolve().name
    about = {"model": str(model_dir), "dtype": dtype, "backend": setup.backend, "slots": args.slots,
             "context": ctx, "draft": args.draft, "plan_summary": setup.plan_summary,
             "plan": [list(row) for row in setup.plan_rows]}

    def load_engine():
        from strata_jax import load_model
        from strata_jax.compile_cache import enable_compile_cache
        from strata_jax.engine import Engine, EngineConfig

        cache_dir = enable_compile_cache(args.compile_cache)
        if cache_dir is not None:
            print(f"compile cache: {cache_dir} (--compile-cache off: none)", flush=True)
        started = time.monotonic()
        print(f"loading {model_dir} ({dtype}) ...", flush=True)
        from strata_jax.engine.sampling import set_branch_mode

        set_branch_mode(args.sampling_branches)
        mesh = mesh_of(args)
        if mesh is not None:
            print(mesh.describe(), flush=True)
        model = load_model(model_dir, dtype=dtype, gpu_experts=gpu_experts, host_kernel=args.host_kernel,
                           host_workers=args.pool_workers, host_path=setup.host_path, copy_slots=args.copy_slots,
                           prefill_copy_slots=setup.prefill_copy_slots, stream_copy=args.stream_copy,
                           host_memory=args.host_memory,
                           mesh=None if mesh is None else mesh.make(), expert_exchange=args.expert_exchange,
                           prefill_attention=args.prefill_attention, fused_decode=args.fused_decode)
        if model.tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer.json: the server needs the tokenizer and chat template")
        print(f"model loaded in {time.monotonic() - started:.1f}s; compiling and warming up the engine ...", flush=True)
        config = EngineConfig(slots=args.slots, max_context=ctx, draft=draft, draft_k=args.draft_k,
                              watchdog_s=args.watchdog, prefill_chunks=setup.chunks, prefill_batch=setup.batch,
                              cache_dtype=args.cache_dtype, prefix_cache_mib=_prefix_cache_mib(args),
                              prefix_cache_device_mib=setup.snapshot_device_mib, decode_share=args.decode_share,
                              mixed_step_ms=args.mixed_step_ms, prefill_burst_ms=args.prefill_burst_ms,
                              share_by_requests=args.share_by_requests)
        drafter = None
        if draft_dir is not None:
            from strata_jax.engine.draft_model import DraftModelDrafter

            print(f"loading draft model {draft_dir} ...", flush=True)
            drafter = DraftModelDrafter(load_model(draft_dir, dtype=dtype), config, model.config.vocab_size)
        engine = Engine(model, config, drafter=drafter)
        engine.start()
        print(f"engine ready ({args.slots} slots x {engine.context_length} tokens of context, {dtype} weights) after "
              f"{time.monotonic() - started:.1f}s", flush=True)
        return engine, model.tokenizer, engine.context_length

    code = serve(load_engine, host=args.host, port=args.port, api_key=args.api_key, served_name=served_name,
                 allow_insecure_public=args.allow_insecure_public, log_format=args.log_format,
                 metrics_public=args.metrics_public, about=about, constrain_tools=not args.no_constrain_tools)
    if code == EXIT_STUCK:  # an engine thread may be stuck in a device call: interpreter shutdown could wait on it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


CACHE_DTYPE_CHOICES = ["bf16", "bfloat16", "float32", "fp8", "int8"]
PREFILL_ATTENTION_HELP = ("how prompt chunks attend to the KV cache: auto (on a GPU, chunks with a QSA selection take "
                          "the selected-keys kernel: 3.8x cuDNN at 20K cached tokens, 9x at 60K; on a Hopper GPU "
                          "plain chunks take cudnn: 3.7-4.2x jnp; jnp elsewhere), jnp (the blocked XLA loop), pallas "
                          "(the flash-style Pallas kernel; Pallas interpret mode off a GPU, slow), cudnn "
                          "(jax.nn.dot_product_attention, cuDNN for bf16 on a GPU, a QSA selection as its mask; an "
                          "int8/fp8 cache uses jnp), selected (chunks with a QSA selection over a float cache: a "
                          "Pallas kernel that reads only each token's selected keys; other chunks as auto). Default "
                          "auto (docs/PERF.md, \"Prefill attention\")")
CACHE_DTYPE_HELP = ("KV cache dtype: bf16 / float32, or int8 / fp8 (e4m3): attention keys and values in one byte "
                    "with a float32 scale per position and kv head, half the bytes of bf16 (the other caches stay "
                    "in --dtype; docs/PERF.md, \"KV cache dtype\", gives the logit error measured). Default: the "
                    "weights' dtype (--dtype)")

EXIT_USAGE = 2  # a bad flag or value, a missing directory (argparse's own code)
EXIT_DOES_NOT_FIT = 3  # plan / serve: the model does not fit the card at this shape
EXIT_CODES = f"""exit codes:
  0   success
  {EXIT_USAGE}   usage error (a bad flag or value, a missing directory or file)
  {EXIT_DOES_NOT_FIT}   plan, serve: does not fit the card (even the minimum of experts on the device)
  70  serve: the engine stayed stuck (--watchdog) and the server exited for a supervisor to restart it"""


class DoesNotFit(ValueError):
    """The memory plan refuses: the model does not fit the card at this shape (exit code EXIT_DOES_NOT_FIT)."""


def _prog() -> str:
    return "strata-jax" if Path(sys.argv[0]).name == "strata-jax" else "python -m strata_jax"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: generate, serve, quantize, plan (and `bench`, handed to strata_jax.bench)."""
    from strata_jax import __version__
    from strata_jax.cli_help import DefaultsFormatter
    from strata_jax.engine.cards import CARDS, cards_help

    prog = prog or _prog()
    parser = argparse.ArgumentParser(
        prog=prog,
        description="strata_jax: serve huge Mixture-of-Experts coding models from one GPU. Start with "
        f"`{prog} serve` (the bundled demo model on http://127.0.0.1:8080, a web chat and monitor at /), or "
        f"`{prog} plan --card 24gb` to see what fits a card.",
        epilog=EXIT_CODES,
        formatter_class=DefaultsFormatter,
    )
    parser.add_argument("--version", action="version", version=f"strata_jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description, epilog=EXIT_CODES,
                              formatter_class=DefaultsFormatter)

    card_names = ", ".join(CARDS)
    card_help = (f"plan for a card of this size instead of the one present: {card_names} (`plan --help` "
                 "lists example cards); the same as --vram-budget-mib with the size's memory")

    gen = command("generate", "continue a prompt with a checkpoint (no server)",
                  "Load a checkpoint directory and continue a prompt (greedy by default), printing the text.")
    gen.add_argument("--model", default=str(DEMO_MODEL), help="checkpoint directory (default: the bundled demo model)")
    gen.add_argument("--prompt", required=True, help="text to continue (required)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                     help="weights' dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    gen.add_argument("--cache-dtype", choices=CACHE_DTYPE_CHOICES, default=None, help=CACHE_DTYPE_HELP)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the checkpoint's chat template as a user turn and print the answer "
                     "only (up to its end-of-turn token, which is not printed)")
    add_mesh_flags(gen)
    gen.set_defaults(func=_generate)

    srv = command(
        "serve", "serve a checkpoint over HTTP to coding agents (Anthropic and OpenAI APIs, web chat and monitor)",
        "Serve a checkpoint: Anthropic Messages API (/v1/messages) for Claude Code, OpenAI chat completions "
        "(/v1/chat/completions), a web chat and live monitor at / (JSON at /v1/monitor), /health and /metrics. "
        "Prints a summary (model, plan, slots x context, how to point Claude Code at it) and then "
        "`listening on URL` when ready. Logs one line per request at its end.",
    )
    srv.add_argument("--model", default=str(DEMO_MODEL), help="checkpoint directory (default: the bundled demo)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind")
    srv.add_argument("--port", type=int, default=8080, help="port; 0 = any free port")
    srv.add_argument("--slots", type=int, default=4, help="concurrent requests decoded together")
    srv.add_argument("--ctx", type=int, default=None,
                     help="context tokens per slot, prompt + output; at least the chat template's smallest prompt "
                     "plus 16. Default: from the memory plan, the largest "
                     f"that fits --slots on the device without moving experts off it, at least {AGENT_CONTEXT:,} "
                     f"where that fits (Claude Code's first request alone is ~34k tokens), up to the model's "
                     f"max_position_embeddings (at most {MAX_DEFAULT_CONTEXT:,}); on a CPU (no device memory "
                     f"statistics) {CPU_CONTEXT:,}. The choice and why are printed at start")
    srv.add_argument("--api-key", default=None, help="require this key (x-api-key or Authorization: Bearer); "
                     "default $STRATA_API_KEY, else no key")
    srv.add_argument("--served-name", default=None, help="model name in /v1/models (default: the model dir's name)")
    srv.add_argument("--vram-reserve-mib", type=int, default=None,
                     help="device memory the memory plan leaves free (default 1536)")
    budget = srv.add_mutually_exclusive_group()
    budget.add_argument("--vram-budget-mib", type=int, default=None,
                        help="plan for a card of this size (default: the device's free memory; on a CPU without it, "
                        "every expert stays resident); experts that do not fit run on the host")
    budget.add_argument("--card", default=None, metavar="SIZE", help=card_help + " (default: the card present)")
    srv.add_argument("--pool-workers", type=int, default=None,
                     help="host expert pool threads (default: the CPU quota granted, minus one)")
    srv.add_argument("--host-kernel", choices=("xla", "numba", "numpy"), default="xla",
                     help="how host experts are computed: xla (compiled by XLA:CPU, default), numba (byte tables "
                     "compiled by numba: 1.3-2.2x less CPU per layer on a 2-core machine, not yet measured on a "
                     "16-core host; its first use compiles for ~30 s) or numpy (the reference, ~2-3x slower)")
    srv.add_argument("--gpu-experts", type=int, default=None,
                     help="experts per MoE layer in the device pool, overriding the plan (packed experts only; "
                     "default: the plan's)")
    srv.add_argument("--host-path", choices=("auto", "stream", "compute"), default="auto",
                     help="how experts outside the device pool are served: stream (kept in pinned host memory and "
                     "copied to the GPU inside each step), compute (computed by the host CPU), or auto (default: "
                     "stream on a GPU, compute elsewhere; the choice and why are printed at start)")
    srv.add_argument("--copy-slots", type=int, default=None, metavar="N",
                     help="streaming: staging rows per round of a decode step, per MoE layer (default: sized for "
                     "each step from its tokens and the pool's share of the experts)")
    srv.add_argument("--stream-copy", choices=STREAM_COPIES, default="auto",
                     help="streaming: how missing experts cross to the GPU: slices (one copy per staging row, every "
                     "row copied), pallas (one kernel per layer reading pinned host memory, unused rows skipped; "
                     "3.6x faster than slices on the H200) or auto (default: pallas on a GPU, slices elsewhere)")
    srv.add_argument("--sampling-branches", choices=("auto", "cond", "select"), default="auto",
                     help="how each step's sampling skips work no slot needs (top-k/top-p sort, draws, grammar "
                     "masks, log-probabilities): cond (skipped, but on a GPU each test syncs with the host mid-step), "
                     "select (always computed, no sync: one user 1.26x faster on the H200) or auto (default: select "
                     "on a GPU for steps of up to 72 sampled rows, i.e. 8 slots with verify windows of 9; cond "
                     "elsewhere)")
    srv.add_argument("--command-buffers", choices=("auto", "stable-scratch", "xla"), default="auto",
                     help="how XLA keeps each step's CUDA graphs: stable-scratch (the step's scratch memory at a "
                     "fixed address, XLA's VMM allocator; jax 0.11: the graphs are not rebuilt every step: one "
                     "user 2x faster on the H200), xla (XLA's default) or auto (default: stable-scratch on a GPU "
                     "with jax 0.11 unless experts are served from the host: that runs under it when asked, not yet "
                     "measured)")
    srv.add_argument("--host-memory", choices=HOST_MEMORIES, default="auto",
                     help="streaming: where the streamed experts' rows live: pinned (jax's pinned host memory), "
                     "mapped (pinned host memory the GPU reads in place, seen by XLA as device memory, so the step "
                     "can run as CUDA graphs) or auto (default: pinned until mapped is measured faster)")
    srv.add_argument("--draft", default="none",
                     help="speculative drafter for every slot: mtp (the checkpoint's MTP head), ngram (prompt "
                     "lookup), a small draft model's checkpoint DIR (same tokenizer, no PLE), or none (default)")
    srv.add_argument("--draft-k", type=int, default=4,
                     help="the longest draft per step and slot (at most 16 for ngram, 8 for mtp or a draft model); "
                          "each slot's length grows and shrinks with its acceptance up to it (docs/ARCHITECTURE.md, "
                          "\"Speculation for every slot\")")
    srv.add_argument("--prefill-chunks", default=None, metavar="N,N,...",
                     type=lambda v: tuple(int(c) for c in v.split(",")),
                     help="prompt chunk sizes compiled at start; the largest bounds how long a prompt chunk delays "
                          "running streams (default: from the plan on a GPU, 32,256,4096 where the workspace keeps "
                          "the device expert pool, else 32,256,2048; 32,256,2048 on a CPU)")
    srv.add_argument("--prefill-batch", type=int, default=None, metavar="N",
                     help="most prompts prefilled together in one call (each compiled count costs start-up time; "
                          "default: 4 on a GPU where the plan allows, else 1; 1 on a CPU)")
    pacing = EngineConfig()
    srv.add_argument("--decode-share", type=float, default=pacing.decode_share, metavar="F",
                     help="while streams decode, other prompts' prefill gets at most 1 - F of the engine's time, so a "
                          "decoding stream keeps about F of its solo rate (0 = no pacing: a prefill piece beside "
                          "every decode step; docs/ARCHITECTURE.md, \"Prefill and decode share the engine\")")
    srv.add_argument("--mixed-step-ms", type=float, default=pacing.mixed_step_ms, metavar="MS",
                     help="beside decoding streams, prompts prefill in pieces whose call took at most MS at warm-up: "
                          "about the longest a decoding stream waits for its next token. Wider pieces prefill "
                          "faster in the same share of time (on an H100 at 16-26K cached tokens a 4,096 x 4 call "
                          "moved 1.9x the prompt tokens per second of 1,024 x 1 pieces), so where many agents "
                          "arrive together a larger MS should bring the last ones' first tokens sooner (8 agents at "
                          "100 ms: the last after 28 s; docs/BENCHMARKS.md, \"Burst length, and eight sessions\")")
    srv.add_argument("--share-by-requests", action=argparse.BooleanOptionalAction, default=pacing.share_by_requests,
                     help="the decoding streams' share (--decode-share) is also at most their part of the requests "
                          "in slots: four prompts waiting beside four streams get half the time, which should "
                          "bring the first tokens of many agents arriving together sooner and slow the running "
                          "streams meanwhile (off by default: not yet measured on a GPU; docs/ARCHITECTURE.md, "
                          "\"Prefill and decode share the engine\")")
    srv.add_argument("--prefill-burst-ms", type=float, default=pacing.prefill_burst_ms, metavar="MS",
                     help="prompts whose whole remaining prefill takes at most MS (agents' later turns: tool results "
                          "on a cached prefix) prefill at once beside decoding streams instead of in paced pieces "
                          "(0 = off)")
    srv.add_argument("--prefix-cache-mib", type=int, default=None, metavar="MIB",
                     help="host memory for prefix-cache snapshots (default: a quarter of the host memory available "
                          "at start, 2,048 to 65,536 MiB; 0 = off)")
    srv.add_argument("--watchdog", type=float, default=120.0, metavar="SECONDS",
                     help="an engine step running longer than this is taken as stuck: its requests fail with a "
                          "retryable error, /health answers 503, and after 30 s more the server exits with code 70 "
                          "for a supervisor to restart it (default 120; 0 = off)")
    srv.add_argument("--allow-insecure-public", action="store_true",
                     help="allow a non-loopback --host without an API key")
    srv.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                     help="weights' dtype (default: bfloat16 on a GPU, float32 on a CPU; the backend is read by "
                     "the start-up device probe)")
    srv.add_argument("--cache-dtype", choices=CACHE_DTYPE_CHOICES, default=None, help=CACHE_DTYPE_HELP)
    srv.add_argument("--compile-cache", default=default_cache_dir(), metavar="DIR|off",
                     help="keep the compiled step functions in DIR so that a restart loads them instead of compiling "
                          "again (jax's persistent compilation cache; ~250 s of compiling for Flash-Next on an H200); "
                          "off: compile every start")
    srv.add_argument("--prefill-attention", choices=PREFILL_ATTENTION_IMPLS, default="auto",
                     help=PREFILL_ATTENTION_HELP)
    srv.add_argument("--fused-decode", action="store_true",
                     help="on a GPU, run each MoE block's router and shared expert and each DeltaNet layer's conv + "
                     "delta rule as fused Pallas kernels for decode and verify steps of up to 16 tokens (off by "
                     "default: 1.25x slower in the decode step on an H100, docs/PERF.md \"Fused decode kernels\")")
    srv.add_argument("--log-format", choices=["text", "json"], default="text",
                     help="logs on stderr (one line per request at its end, access lines for other requests): "
                     "text, or json (one object per line with the request's fields)")
    srv.add_argument("--metrics-public", action="store_true",
                     help="serve /metrics without the API key to clients on this machine (a local Prometheus); "
                     "other clients still need the key")
    srv.add_argument("--no-constrain-tools", action="store_true",
                     help="let the model write tool calls freely. Without this switch offered tools are the answer's "
                     "grammar: calls name only offered tools, arguments follow their schemas, tool_choice holds "
                     "(docs/CLIENTS.md, \"Constrained tool calls and JSON\"); JSON response formats are enforced "
                     "either way")
    add_mesh_flags(srv)
    srv.set_defaults(func=_serve)
    qnt = command(
        "quantize", "convert a HF checkpoint: routed experts to packed 1-bit planes (orbax, resumable)",
        "Convert a Hugging Face checkpoint into a directory with packed 1-bit expert planes, written "
        "part by part with orbax-checkpoint. Re-running resumes an interrupted conversion. load_model and serve "
        "accept the result directly.",
    )
    qnt.add_argument("--model", help="source HF checkpoint directory (default: none; give this or --from-gguf)")
    qnt.add_argument("--from-gguf", metavar="FILE", help="source llama.cpp GGUF file (or a part of a split set) of "
                     "arch qwen4exp / qwen3next (default: none; give this or --model): experts keep its Q1_0 / TQ1_0 "
                     "/ TQ2_0 bits unless --planes/--group are given")
    qnt.add_argument("--out", required=True, help="output directory (required)")
    qnt.add_argument("--group", type=int, default=128, choices=[64, 128, 256], help="inputs per scale")
    qnt.add_argument("--planes", type=int, default=1, choices=[1, 2, 3, 4], help="residual bit-planes")
    qnt.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dense weights' dtype")
    qnt.set_defaults(func=_quantize)
    pln = sub.add_parser(
        "plan",
        help="print the memory plan (what lives on the GPU, what stays in host RAM) and the CPU budget",
        description="Plan device memory for a checkpoint served with --slots x --ctx: dense weights, caches, "
        "workspace, reserve, and how many experts per MoE layer fit on the GPU. Reads config.json (and "
        "strata_quant.json) only, never the weights. Works without the card: name one with --card (or "
        "--vram-budget-mib); on a machine without device memory statistics (a CPU) one of them is required.\n\n"
        f"card sizes (--card):\n{cards_help()}",
        epilog=EXIT_CODES,
        formatter_class=DefaultsFormatter,
    )
    src = pln.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF or converted checkpoint directory (default: the bundled demo)")
    src.add_argument("--preset", default=None,
                     help="a synthetic model at real shapes instead of --model, e.g. flash-next-125b (default: "
                     "none)")
    pln.add_argument("--slots", type=int, default=4, help="concurrent sequences")
    pln.add_argument("--ctx", type=int, default=None,
                     help="context tokens per slot (default: what serve would choose, the largest that fits without "
                     f"moving experts off the device, at least {AGENT_CONTEXT:,} where it fits)")
    pln.add_argument("--planes", type=int, default=None, choices=[0, 1, 2, 3, 4],
                     help="expert bit-planes (default 1; 0 = dense experts; a converted dir's own value wins)")
    pln.add_argument("--group", type=int, default=None, choices=[64, 128, 256],
                     help="inputs per scale (default 128; a converted dir's own value wins)")
    pln.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                     help="dense weights (default bfloat16, serve's default on a GPU)")
    pln.add_argument("--cache-dtype", choices=CACHE_DTYPE_CHOICES, default=None, help=CACHE_DTYPE_HELP)
    pln.add_argument("--vram-reserve-mib", type=int, default=1536, help="device memory to leave free")
    budget = pln.add_mutually_exclusive_group()
    budget.add_argument("--vram-budget-mib", type=int, default=None,
                        help="act as a card of this size in MiB (default: the device's free memory)")
    budget.add_argument("--card", default=None, metavar="SIZE", help=card_help + " (default: the device present)")
    pln.add_argument("--pool-workers", type=int, default=None,
                     help="host expert pool threads (default: the CPU quota granted, minus one)")
    pln.set_defaults(func=_plan)
    sub.add_parser("bench", help="benchmarks, the same as python -m strata_jax.bench (`bench --help` lists the "
                   "modes)", add_help=False)
    return parser


def add_mesh_flags(cmd: argparse.ArgumentParser) -> None:
    """--devices / --mesh / --expert-exchange and the multi-host flags (strata_jax/engine/mesh.py)."""
    group = cmd.add_argument_group("several devices (JAX sharding: experts split, dense weights replicated, slots "
                                   "split)")
    which = group.add_mutually_exclusive_group()
    which.add_argument("--devices", type=int, default=None, metavar="N",
                       help="split the routed experts (or the device expert pool) of every MoE layer over N devices "
                       "and the slots' caches over them (default: one device, no mesh)")
    which.add_argument("--mesh", default=None, metavar="SPEC",
                       help="a data x expert mesh: data=D,expert=E or DxE; experts split over expert, each data group "
                       "holding them all (default: one device, no mesh)")
    group.add_argument("--expert-exchange", choices=["gather", "all_to_all"], default="gather",
                       help="how a decode or verify step moves tokens to the devices holding their experts: gather "
                       "(all-gather, then reduce-scatter of the results) or all_to_all")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="several hosts: process 0's address for jax.distributed.initialize (default: "
                       "$JAX_COORDINATOR_ADDRESS, else a cluster JAX detects, else one host)")
    group.add_argument("--num-processes", type=int, default=None,
                       help="several hosts: processes in all, one per host (default: $JAX_NUM_PROCESSES or detected)")
    group.add_argument("--process-id", type=int, default=None,
                       help="several hosts: this process's index (default: $JAX_PROCESS_ID or detected)")


def mesh_of(args: argparse.Namespace):
    """The `MeshConfig` the flags ask for (None: one device), joining a multi-host run first when asked; kept on
    `args` so that this happens once. ValueError on a bad spec."""
    if not hasattr(args, "mesh_config"):
        from strata_jax.engine.mesh import initialize_distributed, parse_mesh

        config = parse_mesh(getattr(args, "devices", None), getattr(args, "mesh", None),
                            getattr(args, "expert_exchange", "gather"))
        if initialize_distributed(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                  getattr(args, "process_id", None)) and args.command == "serve":
            raise ValueError("serve runs on one host (requests arrive at one process); several hosts work for "
                             "generate and bench")
        args.mesh_config = config
    return args.mesh_config


# A served context must hold the chat template's smallest prompt and at least this many answer tokens.
MIN_ANSWER_TOKENS = 16


def _check_context_fits_the_template(model_dir: Path, ctx: int) -> None:
    """ValueError unless `ctx` tokens hold the chat template's prompt for a one-word user message plus
    MIN_ANSWER_TOKENS: a smaller context would refuse every request."""
    from strata_jax.tokenizer import load_tokenizer

    if not (model_dir / "tokenizer.json").is_file():
        return  # loading reports the missing tokenizer
    tok = load_tokenizer(model_dir)
    smallest = len(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True))
    need = smallest + MIN_ANSWER_TOKENS
    if ctx < need:
        raise ValueError(f"--ctx {ctx} is too small: the chat template alone takes {smallest} tokens for a one-word "
                         f"message, so --ctx must be at least {need} (that prompt plus {MIN_ANSWER_TOKENS} tokens of "
                         f"answer); coding agents need far more (Claude Code's first request is ~34,000 tokens). "
                         "Leave --ctx out to let the memory plan choose")


def _apply_card(args: argparse.Namespace) -> None:
    """`--card SIZE` becomes the --vram-budget-mib of that size (ValueError naming the sizes if unknown)."""
    from strata_jax.engine.cards import card_budget_mib

    if getattr(args, "card", None):
        args.vram_budget_mib = card_budget_mib(args.card)


@dataclasses.dataclass(frozen=True)
class ServeSetup:
    """What serve's start-up plan decided: the device expert pool size (None: every expert resident), the context
    per slot and the weights' dtype; and, for the start-up summary and the monitor, the backend, a one-line
    summary of the plan and its rows (label, value)."""

    gpu_experts: int | None
    ctx: int
    dtype: str
    chunks: tuple[int, ...] = (32, 256)
    batch: int = 1
    backend: str | None = None
    plan_summary: str = ""
    plan_rows: tuple[tuple[str, str], ...] = ()
    host_path: str = "compute"  # how experts outside the pool are served (planner.stream_plan)
    prefill_copy_slots: int | None = None  # streaming: staging rows per round of a prompt chunk
    snapshot_device_mib: int = 0  # the prefix cache's device pool: half the arena the plan leaves unused


def plan_rows(plan) -> tuple[tuple[str, str], ...]:
    """A memory plan as (label, value) rows for the web monitor."""
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    rows = [("budget", f"{gib(plan.budget)} ({plan.budget_source})"),
            ("dense weights", gib(plan.dense_bytes)),
            (f"caches ({plan.slots} x {plan.max_context:,} tokens)", gib(plan.cache_bytes)),
            (f"workspace ({plan.workspace.phase})", gib(plan.workspace.bytes))]
    if plan.moe_layers:
        rows.append((f"experts on the GPU ({plan.gpu_experts} of {plan.num_experts} per layer)",
                     gib(plan.gpu_expert_bytes)))
        if plan.host_expert_bytes:
            rows.append(("experts in host RAM", gib(plan.host_expert_bytes)))
    rows += [("reserve (kept free)", gib(plan.reserve)), ("planned on the GPU", gib(plan.device_bytes))]
    return tuple(rows)


def plan_summary(plan) -> str:
    """A memory plan in one line for the start-up summary."""
    experts = ""
    if plan.moe_layers:
        experts = f", {plan.gpu_experts} of {plan.num_experts} experts per layer on the GPU"
        if plan.host_expert_bytes:
            experts += f" (the rest, {plan.host_expert_bytes / 2**30:.1f} GiB, in host RAM)"
    return (f"{plan.device_bytes / 2**30:.1f} of {plan.budget / 2**30:.1f} GiB on the device planned{experts}, "
            f"{plan.reserve / 2**30:.1f} GiB kept free")


def _serve_plan(args: argparse.Namespace, model_dir: Path) -> ServeSetup:
    """serve's start-up plan: probe the device (in a child process, so that this process's backend starts only after
    the allocator's environment is set), choose the weights' dtype and the context where not given, plan, print the
    plan and the CPU budget, set the allocator's environment. Raises ValueError when the plan refuses."""
    import os

    from strata_jax.host.cpu_quota import cpu_budget, describe
    from strata_jax.engine import command_buffers
    from strata_jax.engine.config import EngineConfig
    from strata_jax.engine.planner import (
        DEFAULT_RESERVE_MIB,
        allocator_env,
        apply_env,
        choose_context,
        choose_prefill,
        default_dtype,
        format_plan,
        make_plan,
        probe_device,
        stream_plan,
    )

    if args.gpu_experts is not None and not (model_dir / "strata_quant.json").is_file():
        raise ValueError("--gpu-experts needs packed experts: convert the checkpoint with `python -m strata_jax "
                         "quantize` first")
    budget = cpu_budget(pool_workers=args.pool_workers)
    probe = probe_device()
    device = probe.memory
    dtype = args.dtype or default_dtype(probe.backend)  # load_model builds dense weights in it, whatever was stored
    if args.dtype is None:
        seen = f"the {probe.backend} backend" if probe.backend else "the device probe failed"
        print(f"weights: {dtype} (default for {seen}; --dtype to change)", flush=True)
    cfg, quant, _, with_mtp = _checkpoint_shapes(model_dir, None, None, dtype, quantized_only=True)
    reserve = DEFAULT_RESERVE_MIB if args.vram_reserve_mib is None else args.vram_reserve_mib
    engine = EngineConfig(slots=args.slots, prefill_chunks=(32, 256, 2048), cache_dtype=args.cache_dtype)
    ctx = choose_context(args.ctx, cfg, quant, engine, weights_dtype=dtype, with_mtp=with_mtp,
                         vram_reserve_mib=reserve, vram_budget_mib=args.vram_budget_mib, device=device)
    print(f"context: {args.slots} slots x {ctx.tokens} tokens ({ctx.reason})", flush=True)
    engine = dataclasses.replace(engine, max_context=ctx.tokens)
    prefill = choose_prefill(args.prefill_chunks, args.prefill_batch, cfg, quant, engine, weights_dtype=dtype,
                             with_mtp=with_mtp, vram_reserve_mib=reserve, vram_budget_mib=args.vram_budget_mib,
                             device=device)
    engine = dataclasses.replace(engine, prefill_chunks=prefill.chunks, prefill_batch=prefill.batch)
    print(f"prefill: chunks of {','.join(map(str, engine.prefill_chunks))} tokens, up to {max(engine.prefill_batches)} "
          f"prompt(s) per call ({prefill.reason})", flush=True)
    shapes = dict(chunks=engine.prefill_chunks, batch=engine.prefill_batch, backend=probe.backend)
    if ctx.tokens > cfg.max_position_embeddings:
        print(f"note: the context exceeds the model's max_position_embeddings ({cfg.max_position_embeddings}): "
              "positions past it were not trained", flush=True)
    if device is None and args.vram_budget_mib is None:
        print(describe(budget), flush=True)
        if args.gpu_experts is not None:
            print(f"host expert tier: --gpu-experts {args.gpu_experts} experts per MoE layer in the device pool, "
                  f"the others computed by {budget.workers} host worker(s) ({args.host_kernel})", flush=True)
            return ServeSetup(args.gpu_experts, ctx.tokens, dtype, **shapes, plan_summary=(
                f"--gpu-experts {args.gpu_experts} per MoE layer on the device (no device statistics)"))
        print("memory plan: no device memory statistics (CPU backend) and no --vram-budget-mib: every weight stays "
              "resident", flush=True)
        return ServeSetup(None, ctx.tokens, dtype, **shapes, plan_summary=(
            "every weight resident (no device memory statistics on this backend: no plan)"))
    plan = make_plan(cfg, quant, engine, weights_dtype=dtype,
                     with_mtp=with_mtp, vram_reserve_mib=reserve, vram_budget_mib=args.vram_budget_mib, device=device)
    mesh = mesh_of(args)
    if mesh is not None and mesh.devices > 1:  # each device's plan; the pool below is every device's part
        from strata_jax.engine.planner import format_device_plan, make_device_plan

        per_device = make_device_plan(cfg, quant, engine, devices=mesh.devices, expert_shards=mesh.expert,
                                      weights_dtype=dtype, with_mtp=with_mtp, vram_reserve_mib=reserve,
                                      vram_budget_mib=args.vram_budget_mib, device=device)
        print(format_device_plan(per_device), flush=True)
        plan = dataclasses.replace(per_device.plan, gpu_experts=per_device.gpu_experts, num_experts=cfg.num_experts)
    else:
        print(format_plan(plan), flush=True)
    print(describe(budget), flush=True)
    if not plan.fits:
        raise DoesNotFit(plan.message)
    if quant is None and plan.gpu_experts < plan.num_experts:
        raise ValueError(f"only {plan.gpu_experts} of {plan.num_experts} experts per layer fit, and the host tier "
                         "needs packed experts: convert the checkpoint with `python -m strata_jax quantize`")
    apply_env(allocator_env(plan), os.environ)
    pool = plan.gpu_experts if plan.moe_layers and plan.gpu_experts < plan.num_experts else None
    if args.gpu_experts is not None:
        pool = args.gpu_experts
        print(f"--gpu-experts {pool} overrides the plan's pool of {plan.gpu_experts}", flush=True)
    streaming = stream_plan(plan, engine, probe.backend, args.host_path, args.copy_slots)
    print(command_buffers.configure(args.command_buffers, probe.backend, pool is not None), flush=True)
    if pool is not None and streaming.host_path == "stream":
        if args.gpu_experts is None:
            pool = streaming.gpu_experts
        print(f"host expert tier: {pool} of {plan.num_experts} experts per MoE layer in the device pool, the others "
              f"streamed from pinned host memory ({streaming.reason}); hot experts are promoted while serving",
              flush=True)
        return ServeSetup(pool, ctx.tokens, dtype, **shapes, plan_summary=plan_summary(plan),
                          plan_rows=plan_rows(plan), host_path="stream",
                          prefill_copy_slots=streaming.prefill_copy_slots)
    if pool is not None:
        print(f"host expert tier: {pool} of {plan.num_experts} experts per MoE layer in the device pool, the others "
              f"computed by {budget.workers} host worker(s) ({args.host_kernel}; {streaming.reason}); hot experts "
              "are promoted while serving", flush=True)
    # Every expert resident: half of the arena the plan leaves unused keeps recent prefix snapshots on the device
    # (restored device to device); with a host tier that memory should go to experts instead.
    spare = (plan.budget - plan.device_bytes) // 2 >> 20 if pool is None else 0
    return ServeSetup(pool, ctx.tokens, dtype, **shapes, plan_summary=plan_summary(plan), plan_rows=plan_rows(plan),
                      snapshot_device_mib=max(spare, 0))


def _checkpoint_shapes(model_dir: Path, planes: int | None, group: int | None, dtype: str | None,
                       quantized_only: bool = False):
    """(config, expert format, weights dtype, has MTP) of a checkpoint, from config.json and headers only. A
    converted directory's own format wins; for a HF directory `planes` (default 1; 0 = dense) says how it would be
    quantized, or, with `quantized_only` (serve loads HF experts dense), the experts are dense."""
    from strata_jax.model.config import ExpertQuantization, load_config

    if Path(model_dir).suffix == ".gguf":
        from strata_jax.weights.gguf_loader import gguf_shapes

        cfg, quant = gguf_shapes(model_dir)
        return cfg, quant, dtype or "bfloat16", False
    cfg = load_config(model_dir)
    if (model_dir / "strata_quant.json").is_file():
        from strata_jax.weights.convert import read_marker

        meta = read_marker(model_dir)
        planes, group, dtype = meta["planes"], meta["group"], meta.get("dtype", dtype)
        with_mtp = (model_dir / "params" / "mtp").is_dir()
    else:
        from strata_jax.weights.loader import has_mtp
        from strata_jax.weights.safetensors_io import CheckpointReader

        with_mtp = has_mtp(CheckpointReader(model_dir))  # safetensors headers only
        if quantized_only:
            planes = 0
    planes = 1 if planes is None else planes
    quant = ExpertQuantization(planes=planes, group=group or 128) if planes else None
    return cfg, quant, dtype or "bfloat16", with_mtp


def _plan(args: argparse.Namespace) -> int:
    import os

    from strata_jax.engine.cards import CARDS
    from strata_jax.engine.planner import PROBE_ENV, apply_env

    _apply_card(args)

    # Before JAX's backend starts: a limit of the whole card and no preallocation, so memory_stats shows the card.
    apply_env(PROBE_ENV, os.environ)
    from strata_jax.model.config import ExpertQuantization
    from strata_jax.engine.config import EngineConfig
    from strata_jax.host.cpu_quota import cpu_budget, describe
    from strata_jax.engine.planner import choose_context, device_memory, format_plan, make_plan

    if args.preset:
        from strata_jax.bench.synthetic import preset_config

        cfg, with_mtp, dtype = preset_config(args.preset), False, args.dtype or "bfloat16"
        planes = 1 if args.planes is None else args.planes
        quant = ExpertQuantization(planes=planes, group=args.group or 128) if planes else None
    else:
        cfg, quant, dtype, with_mtp = _checkpoint_shapes(Path(args.model or DEMO_MODEL), args.planes, args.group,
                                                         args.dtype)
    engine = EngineConfig(slots=args.slots, cache_dtype=args.cache_dtype)
    device = device_memory()
    if device is None and args.vram_budget_mib is None:
        raise ValueError("this machine's backend reports no device memory (a CPU?): name the card to plan for, "
                         f"e.g. --card 24gb (sizes: {', '.join(CARDS)}) or --vram-budget-mib 24564")
    ctx = choose_context(args.ctx, cfg, quant, engine, weights_dtype=dtype, with_mtp=with_mtp,
                         vram_reserve_mib=args.vram_reserve_mib, vram_budget_mib=args.vram_budget_mib, device=device)
    plan = make_plan(cfg, quant, dataclasses.replace(engine, max_context=ctx.tokens), weights_dtype=dtype,
                     with_mtp=with_mtp, vram_reserve_mib=args.vram_reserve_mib, vram_budget_mib=args.vram_budget_mib,
                     device=device)
    if ctx.source != "flag":
        print(f"context: {args.slots} slots x {ctx.tokens} tokens ({ctx.reason})")
    print(format_plan(plan))
    host_tier = bool(plan.moe_layers and plan.gpu_experts < plan.num_experts)
    if plan.fits and host_tier:
        from strata_jax.engine.planner import stream_plan

        streaming = stream_plan(plan, dataclasses.replace(engine, max_context=ctx.tokens), "gpu")
        print(f"experts outside the pool, served on a GPU (serve --host-path auto): {streaming.reason}")
    if plan.fits:
        from strata_jax.engine.command_buffers import choose_mode

        mode, why = choose_mode("auto", "gpu", host_tier, os.environ)
        print(f"command buffers on a GPU (serve --command-buffers auto): {mode} ({why})")
    print(describe(cpu_budget(pool_workers=args.pool_workers)), flush=True)
    if not plan.fits:
        print(f"error: {plan.message}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line on `argv` (default: sys.argv[1:]); returns the exit code (EXIT_CODES)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark wing has its own parser (python -m strata_jax.bench)
        from strata_jax.bench.main import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except DoesNotFit as e:  # the planner's message starts with "does not fit"
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
