"""`python -m strata_jax.bench --mode agents`: N concurrent coding-agent sessions shaped like Claude Code's.

Each session is a multi-turn conversation: a first turn of ~20-27K tokens whose system prompt and tool definitions
are the same in every session (on a model with a tokenizer: Claude Code's captured first request, rendered with
the model's chat template, the user message made per session; on a synthetic model: random token ids of the same
structure), then `--turns` later turns, each appending the answer and a tool result of `--tool-tokens` tokens to the
conversation, token for token as the server's rendering does, and generating `--answer-tokens` tokens. Sessions
arrive `--stagger-s` apart (`--together`: at once).

Reported per session count: time to first token p50 / p95 by turn kind (first / later), each session's decode
tok/s while other sessions prefill (and while none does), aggregate tok/s, prefix-cache hit tokens, and the prefix
cache's snapshot time and memory (engine stats). One engine with max(--sessions) slots serves every count (as one
server would), under each pacing of prefill beside decoding given (`--decode-share`, `--mixed-step-ms`,
`--prefill-burst-ms`, `--share-by-requests`: changed on the running engine, no compile); each run's conversations
start with a different token, so no run reuses another's prefixes, or with `--same-conversations` every run of a
session count has the same conversations (the prefix cache is emptied between runs either way): rows that differ
only in pacing then differ by the pacing, not by their prompts' lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Callable
from importlib import resources

import jax
import numpy as np

from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine.call_log import by_shape
from strata_jax.loaded_model import LoadedModel

TRACE_CALLS = 200_000  # --trace: the engine keeps this many calls (a row of 8 agents makes ~10,000)
_TOOL_TEXT = "    def handle(self, request):\n        return self.router.dispatch(request.path, request.body)\n"


def agents_args(p: argparse.ArgumentParser) -> None:
    """The agents mode's flags (it also uses --preset/--model-dir, --ctx, --prefill-chunks, --prefill-batch,
    --prefix-cache-mib and --dtype)."""
    g = p.add_argument_group("agents mode")
    ints = lambda v: tuple(int(x) for x in v.split(","))  # noqa: E731
    g.add_argument("--sessions", default="1,4,8", type=ints, help="comma-separated concurrent session counts")
    g.add_argument("--turns", type=int, default=3, help="later turns per session, after the first")
    g.add_argument("--first-turn", choices=["claude-code", "synthetic"], default=None,
                   help="first turns from Claude Code's captured request (default with a tokenizer) or synthetic "
                        "token ids (default without one)")
    g.add_argument("--shared-tokens", type=int, default=16000,
                   help="synthetic first turns: tokens every session shares (system prompt and tools)")
    g.add_argument("--first-tokens", default="20000,27000", type=ints,
                   help="synthetic first turns: MIN,MAX tokens (the shared ones included)")
    g.add_argument("--tool-tokens", default="300,4000", type=ints, help="MIN,MAX tokens of each tool result")
    g.add_argument("--answer-tokens", default="50,500", type=ints, help="MIN,MAX tokens generated per turn")
    g.add_argument("--stagger-s", type=float, default=2.0, help="seconds between session arrivals")
    g.add_argument("--together", action="store_true", help="every session arrives at once (--stagger-s 0)")
    floats = lambda v: tuple(float(x) for x in v.split(","))  # noqa: E731
    g.add_argument("--decode-share", type=floats, default=None, metavar="SHARE[,SHARE...]",
                   help="EngineConfig.decode_share (default the engine's: 0.7); several: each session count runs "
                        "under each, on the same engine (no compile in between)")
    g.add_argument("--mixed-step-ms", type=floats, default=None, metavar="MS[,MS...]",
                   help="EngineConfig.mixed_step_ms (default the engine's: 100); several: as --decode-share (every "
                        "pair of the two lists)")
    g.add_argument("--prefill-burst-ms", type=floats, default=None, metavar="MS[,MS...]",
                   help="EngineConfig.prefill_burst_ms (default the engine's: 500; 0 = off); several: as "
                        "--decode-share (every combination of the lists)")
    onoff = lambda v: tuple({"on": True, "off": False}[x] for x in v.split(","))  # noqa: E731
    g.add_argument("--share-by-requests", type=onoff, default=None, metavar="off|on[,...]",
                   help="EngineConfig.share_by_requests (default the engine's: off): the decoders' share is at most "
                        "their part of the requests in slots; several (off,on): as --decode-share")
    g.add_argument("--prefix-cache-device-mib", type=int, default=0,
                   help="EngineConfig.prefix_cache_device_mib: device memory for recent snapshots (default 0; cut "
                        "after warm-up to what fits beside the largest step's workspace)")
    g.add_argument("--share-min-tokens", type=int, default=None,
                   help="EngineConfig.share_min_tokens (default the engine's: 1024)")
    g.add_argument("--snapshot-every", type=int, default=None,
                   help="EngineConfig.snapshot_every (default the engine's: 1024)")
    g.add_argument("--agents-seed", type=int, default=0, help="seed of the sizes and synthetic tokens")
    g.add_argument("--same-conversations", action="store_true",
                   help="every run of a session count on the same conversations (default: each run its own), so "
                        "that rows of one count under several pacings, or repeated counts (--sessions 4,4), compare "
                        "like with like; the prefix cache is emptied between runs, so no run reuses another's work")
    g.add_argument("--trace", action="store_true",
                   help="keep the engine's calls (EngineConfig.call_log): each row's JSON gets `calls` (every "
                        "prefill call with its prompts' pieces, decode steps, restores and snapshots, in seconds "
                        "from the row's first submission) and `prefill_calls_by_shape`, printed after the row")


def claude_code_body() -> dict:
    """Claude Code's first Messages request (captured; its text scrambled), as shipped with the bench."""
    return json.loads(resources.files("strata_jax.bench").joinpath("data/claude_code_first_turn.json").read_text())


def claude_code_first_turns(tokenizer, sessions: int, run: int) -> list[tuple[int, ...]]:
    """Each session's first prompt: Claude Code's first request rendered like the server renders it, its user
    message made per session and its system prompt tagged with `run` (different runs share no prefix)."""
    from server.anthropic_request import parse_messages_request
    from server.prompt import render_prompt

    out = []
    for s in range(sessions):
        body = claude_code_body()
        body["system"][1]["text"] = f"[run {run}] " + body["system"][1]["text"]
        blocks = body["messages"][0]["content"]
        blocks[-1]["text"] = f"Session {s}: fix the failing test in module_{s}.py. " + blocks[-1]["text"]
        out.append(tuple(render_prompt(tokenizer, parse_messages_request(body).prompt).ids))
    return out


def synthetic_first_turns(vocab: int, sessions: int, shared: int, lengths: tuple[int, int],
                          rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Random first prompts: `shared` tokens common to all (starting with a token of this run), the rest each
    session's own, lengths drawn from `lengths` (MIN, MAX)."""
    common = [int(t) for t in rng.integers(0, vocab, shared)]
    out = []
    for _ in range(sessions):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        out.append(tuple(common[:n] + [int(t) for t in rng.integers(0, vocab, max(n - shared, 0))]))
    return out


def tool_result(tokenizer, vocab: int, n: int, rng: np.random.Generator) -> tuple[int, ...]:
    """`n` tokens of a tool result closing the assistant turn and opening the next (chat-formatted code with a
    tokenizer, random ids without one)."""
    if tokenizer is None:
        return tuple(int(t) for t in rng.integers(0, vocab, n))
    head = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n")
    tail = tokenizer.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    body = tokenizer.encode(_TOOL_TEXT * (n // 8 + 1))[: max(n - len(head) - len(tail), 1)]
    return tuple(head + body + tail)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _turn(engine: Engine, prompt: tuple[int, ...], max_tokens: int) -> dict:
    submitted = time.perf_counter()
    stream = await engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    times, ids, cached = [], [], 0
    async for ev in stream:
        if ev.prompt_tokens:
            cached = ev.cached_tokens
        if ev.token_id is not None:
            times.append(time.perf_counter())
            ids.append(ev.token_id)
        if ev.finish_reason == "error":
            raise RuntimeError(f"a turn failed: {ev.error}")
    return {"submitted": submitted, "first": times[0], "times": times, "ids": ids, "cached": cached,
            "prompt_tokens": len(prompt)}


async def _session(engine: Engine, first: tuple[int, ...], delay: float, turns: int, tool, answers) -> list[dict]:
    await asyncio.sleep(delay)
    prompt, out = first, []
    for t in range(turns + 1):
        record = await _turn(engine, prompt, answers[t])
        record["kind"] = "first" if t == 0 else "later"
        out.append(record)
        if t < turns:
            prompt = prompt + tuple(record["ids"]) + tool[t]
    return out


def _decode_rates(sessions: list[list[dict]]) -> list[tuple[float | None, float | None]]:
    """Per session: (decode tok/s over its inter-token gaps that overlap another session's prefill, over the
    others). A session prefills from submitting a turn to that turn's first token."""
    prefills = [[(r["submitted"], r["first"]) for r in turns] for turns in sessions]
    out = []
    for i, turns in enumerate(sessions):
        others = [iv for j, ivs in enumerate(prefills) if j != i for iv in ivs]
        busy = [0, 0.0]
        quiet = [0, 0.0]
        for r in turns:
            for a, b in zip(r["times"], r["times"][1:]):
                side = busy if any(s < b and a < e for s, e in others) else quiet
                side[0] += 1
                side[1] += b - a
        out.append(tuple(n / s if s > 0 else None for n, s in (busy, quiet)))
    return out


def _answer_rate(turns: list[dict]) -> float | None:
    """Mean over turns of each answer's tok/s from its first token to its last: what a decoding session gets over
    a whole answer, pauses for others' prefill included (a burst of prefill pauses decoders briefly and so weighs
    on the rate "while others prefill" more than on this)."""
    rates = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in turns
             if len(r["times"]) > 1 and r["times"][-1] > r["times"][0]]
    return statistics.mean(rates) if rates else None


def _inputs(args, model: LoadedModel, sessions: int, run: int, rng: np.random.Generator):
    vocab = model.config.vocab_size
    source = args.first_turn or ("claude-code" if model.tokenizer is not None else "synthetic")
    if source == "claude-code":
        if model.tokenizer is None:
            raise ValueError("--first-turn claude-code needs a model with a tokenizer (not a synthetic preset)")
        firsts = claude_code_first_turns(model.tokenizer, sessions, run)
    else:
        firsts = synthetic_first_turns(vocab, sessions, args.shared_tokens, args.first_tokens, rng)
    tools = [[tool_result(model.tokenizer, vocab, int(rng.integers(args.tool_tokens[0], args.tool_tokens[1] + 1)),
                          rng) for _ in range(args.turns)] for _ in range(sessions)]
    answers = [[int(rng.integers(args.answer_tokens[0], args.answer_tokens[1] + 1)) for _ in range(args.turns + 1)]
               for _ in range(sessions)]
    return firsts, tools, answers


def run_inputs(args, model: LoadedModel, counts: list[int], rng: np.random.Generator) -> list[tuple]:
    """Each run's (first turns, tool results, answer lengths), for runs of `counts` sessions: each run's conversations
    start with a token of its own (no run reuses another's prefixes), or, with `--same-conversations`, every run of a
    count takes the first such run's."""
    inputs, first_of = [], {}
    for run, n in enumerate(counts):
        if args.same_conversations and n in first_of:
            inputs.append(inputs[first_of[n]])
            continue
        first_of.setdefault(n, run)
        inputs.append(_inputs(args, model, n, run, rng))
    return inputs


def agents_context(args, longest_first: int) -> int:
    """The slots' context: `--ctx`, or what the longest conversation can reach."""
    needed = longest_first + args.turns * (args.tool_tokens[1] + args.answer_tokens[1]) + args.answer_tokens[1] + 16
    if args.ctx is not None and args.ctx < needed:
        raise ValueError(f"--ctx {args.ctx} is smaller than the longest conversation can grow ({needed} tokens)")
    return args.ctx or needed


def run_agents(args, model: LoadedModel, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Runs each session count of `args.sessions` on one engine, under each pacing (`--decode-share` x
    `--mixed-step-ms` x `--prefill-burst-ms` x `--share-by-requests`), the prefix cache emptied between runs;
    returns one row per (pacing, count). A lone session runs once, under the first pacing: pacing splits the
    engine's time between decoding and other slots' prefill, and alone it has no other slots. `on_row(rows)` after
    each (the JSON file is rewritten then, so a run cut by a time limit keeps its finished rows)."""
    rng = np.random.default_rng(args.agents_seed)
    pacings = list(itertools.product(args.decode_share or (None,), args.mixed_step_ms or (None,),
                                     args.prefill_burst_ms or (None,), args.share_by_requests or (None,)))
    runs = [(pacing, n) for i, pacing in enumerate(pacings) for n in args.sessions if n > 1 or i == 0]
    inputs = run_inputs(args, model, [n for _, n in runs], rng)
    ctx = agents_context(args, max(len(f) for firsts, _, _ in inputs for f in firsts))
    extra = {k: v for k, v in (("decode_share", pacings[0][0]), ("mixed_step_ms", pacings[0][1]),
                               ("prefill_burst_ms", pacings[0][2]), ("share_by_requests", pacings[0][3]),
                               ("share_min_tokens", args.share_min_tokens), ("snapshot_every", args.snapshot_every))
             if v is not None}
    config = EngineConfig(slots=max(args.sessions), max_context=ctx, prefill_chunks=args.prefill_chunks,
                          prefill_batch=args.prefill_batch, prefix_cache_mib=args.prefix_cache_mib,
                          prefix_cache_device_mib=args.prefix_cache_device_mib,
                          call_log=TRACE_CALLS if args.trace else 0, **extra)
    engine = Engine(model, config)
    engine.start()
    rows = []
    try:
        for run, (((share, step_ms, burst_ms, by_requests), n), (firsts, tools, answers)) in enumerate(
                zip(runs, inputs)):
            engine.set_prefill_pacing(decode_share=share, mixed_step_ms=step_ms, prefill_burst_ms=burst_ms,
                                      share_by_requests=by_requests)
            if run:  # each row starts as a fresh server would: no earlier row's snapshots filling the pools
                engine.clear_prefix_cache()
            stagger = 0.0 if args.together else args.stagger_s
            before = engine.stats()

            async def all_sessions():
                return await asyncio.gather(*[_session(engine, firsts[s], s * stagger, args.turns, tools[s],
                                                       answers[s]) for s in range(n)])

            started = time.perf_counter()
            sessions = asyncio.run(all_sessions())
            wall = time.perf_counter() - started
            rows.append(_row(n, args, engine.config, sessions, wall, before, engine.stats()))
            _print_row(rows[-1])
            if args.trace:
                _add_calls(rows[-1], engine.calls(since=started), min(r["submitted"] for s in sessions for r in s))
            if on_row is not None:
                on_row(rows)
    finally:
        engine.shutdown()
    return rows


def _row(n: int, args, config: EngineConfig, sessions: list[list[dict]], wall: float, before: dict,
         after: dict) -> dict:
    turns = [r for s in sessions for r in s]
    ttft = {k: [r["first"] - r["submitted"] for r in turns if r["kind"] == k] for k in ("first", "later")}
    rates = _decode_rates(sessions)
    busy = [b for b, _ in rates if b is not None]
    quiet = [q for _, q in rates if q is not None]
    delta = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731
    return {
        "sessions": n, "turns": args.turns + 1, "together": bool(args.together or args.stagger_s == 0),
        "same_conversations": args.same_conversations,
        "slots": config.slots, "ctx": config.max_context, "prefill_chunks": list(config.prefill_chunks),
        "prefill_batch": config.prefill_batch, "decode_share": config.decode_share,
        "share_by_requests": config.share_by_requests,
        "mixed_step_ms": config.mixed_step_ms, "prefill_burst_ms": config.prefill_burst_ms,
        "mixed_prefill": [after.get("mixed_prefill_width"), after.get("mixed_prefill_prompts")],
        "first_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in turns if r["kind"] == "first"),
        **{f"ttft_{k}_p{q}_s": _pct(v, q / 100) for k, v in ttft.items() for q in (50, 95)},
        "decode_tok_s_while_others_prefill": statistics.mean(busy) if busy else None,
        "decode_tok_s_otherwise": statistics.mean(quiet) if quiet else None,
        "decode_tok_s_while_others_prefill_per_session": [b for b, _ in rates],
        "answer_tok_s": _answer_rate(turns),
        "aggregate_tok_s": sum(len(r["ids"]) for r in turns) / wall,
        "wall_s": wall,
        "prefix_cache_hit_tokens": sum(r["cached"] for r in turns),
        "prompt_tokens": sum(r["prompt_tokens"] for r in turns),
        "prefix_cache_hits": delta("prefix_cache_hits_total"),
        "prefix_cache_misses": delta("prefix_cache_misses_total"),
        "snapshots_taken": delta("prefix_cache_snapshots_taken_total"),
        "snapshot_seconds": delta("prefix_cache_snapshot_seconds_total"),
        "snapshot_land_wait_seconds": delta("prefix_cache_land_wait_seconds_total"),
        "prefix_cache_bytes": after.get("prefix_cache_bytes"),
        "prefix_cache_device_bytes": after.get("prefix_cache_device_bytes"),
        "shared_prefix_waits": delta("shared_prefix_waits_total"),
        "prefill_deferred": delta("prefill_deferred_total"),
        "prefill_bursts": delta("prefill_bursts_total"),
        "max_decode_stall_s": after.get("max_decode_stall_seconds"),
        "measured_on": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "timeline": _timeline(sessions),
    }


def _add_calls(row: dict, calls, origin: float) -> None:
    """`--trace`: the row's engine calls (seconds from `origin`, its first submission) and its prefill calls per
    shape, printed."""
    shapes = by_shape(calls)
    row["calls"] = [c.as_dict(origin) for c in calls]
    row["prefill_calls_by_shape"] = {k: [n, round(s, 4)] for k, (n, s) in shapes.items()}
    print("  prefill calls by shape (calls, seconds): "
          + (", ".join(f"{k} {n} ({s:.2f} s)" for k, (n, s) in shapes.items()) or "none"), flush=True)


def _timeline(sessions: list[list[dict]]) -> list[dict]:
    """Every turn in submission order, seconds from the first submission: when it was submitted, its first token
    and its last, with its prompt and cached tokens (where a scheduling policy shows: who waited behind whom)."""
    t0 = min(r["submitted"] for turns in sessions for r in turns)
    rows = [{"session": i, "kind": r["kind"], "submitted_s": r["submitted"] - t0, "first_token_s": r["first"] - t0,
             "last_token_s": (r["times"][-1] if r["times"] else r["first"]) - t0,
             "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached"], "answer_tokens": len(r["ids"])}
            for i, turns in enumerate(sessions) for r in turns]
    return sorted(rows, key=lambda r: r["submitted_s"])


def _s(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _share(r: dict) -> str:
    """The row's decode share, "0.7 by requests" with `share_by_requests`."""
    return f"{r['decode_share']:g}" + (" by requests" if r.get("share_by_requests") else "")


def _print_row(r: dict) -> None:
    print(f"agents {r['sessions']} (decode share {_share(r)}, mixed step {r['mixed_step_ms']:g} ms, "
          f"burst {r['prefill_burst_ms']:g} ms): "
          f"first-turn TTFT p50/p95 {_s(r['ttft_first_p50_s'])}/{_s(r['ttft_first_p95_s'])} s, "
          f"later {_s(r['ttft_later_p50_s'])}/{_s(r['ttft_later_p95_s'])} s, decode "
          f"{_s(r['decode_tok_s_while_others_prefill'], '.1f')} tok/s while others prefill "
          f"({_s(r['decode_tok_s_otherwise'], '.1f')} otherwise; {_s(r['answer_tok_s'], '.1f')} over whole "
          f"answers), aggregate {r['aggregate_tok_s']:.1f} tok/s, "
          f"{r['prefix_cache_hit_tokens']:,} of {r['prompt_tokens']:,} prompt tokens cached", flush=True)


def print_agents_table(rows: list[dict]) -> None:
    """The rows as a markdown table."""
    print(f"\nMeasured on {rows[0]['measured_on'] if rows else '-'}; one engine of {rows[0]['slots'] if rows else '-'} "
          "slots serves every count.")
    print("\n| sessions | pacing: decode share, mixed step ms (pieces), burst ms | first TTFT p50 / p95 s "
          "| later TTFT p50 / p95 s | decode tok/s while others prefill (otherwise; over whole answers) "
          "| aggregate tok/s | cached / prompt tokens | snapshots (s, MiB held) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        held = (r["prefix_cache_bytes"] or 0) / 2**20
        width, prompts = r["mixed_prefill"]
        print(f"| {r['sessions']} | {_share(r)}, {r['mixed_step_ms']:g} ({width} x {prompts}), "
              f"{r['prefill_burst_ms']:g} "
              f"| {_s(r['ttft_first_p50_s'])} / {_s(r['ttft_first_p95_s'])} "
              f"| {_s(r['ttft_later_p50_s'])} / {_s(r['ttft_later_p95_s'])} "
              f"| {_s(r['decode_tok_s_while_others_prefill'], '.1f')} ({_s(r['decode_tok_s_otherwise'], '.1f')}; "
              f"{_s(r['answer_tok_s'], '.1f')}) "
              f"| {r['aggregate_tok_s']:.1f} | {r['prefix_cache_hit_tokens']:,} / {r['prompt_tokens']:,} "
              f"| {r['snapshots_taken']} ({r['snapshot_seconds']:.2f} s, {held:,.0f}) |")
