"""`python -m strata_jax.bench --mode agents`: Claude Code's first turn rendered per session (a long common prefix,
then each session's own), and a tiny run on the demo model whose JSON rows carry every reported figure, with the
sessions' common prefix served from the prefix cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from strata_jax.bench.agents import claude_code_first_turns, synthetic_first_turns, tool_result
from strata_jax.bench import main as bench_main
from strata_jax.bench.main import build_parser, main, settle_planes
from strata_jax.bench.users import bench_model
from strata_jax.demo import DEMO_MODEL
from strata_jax.tokenizer import Tokenizer


def test_claude_code_first_turns_share_the_system_prompt_and_tools():
    tok = Tokenizer(DEMO_MODEL)
    a, b = claude_code_first_turns(tok, 2, run=0)
    other_run = claude_code_first_turns(tok, 1, run=1)[0]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 20_000 < len(a) < 40_000 and common > 0.85 * len(a)  # system prompt and tools: all but the user message
    assert next(i for i, (x, y) in enumerate(zip(a, other_run)) if x != y) < 0.05 * len(a)
    assert tok.decode(a).rstrip().endswith("<|im_start|>assistant") or "<|im_start|>assistant" in tok.decode(a[-8:])
    result = tool_result(tok, tok.vocab_size, 300, np.random.default_rng(0))
    assert len(result) == 300 and "<tool_response>" in tok.decode(result)


def test_synthetic_first_turns_have_the_requested_structure():
    firsts = synthetic_first_turns(1000, 3, 50, (60, 80), np.random.default_rng(1))
    assert all(60 <= len(f) <= 80 and f[:50] == firsts[0][:50] for f in firsts)
    assert len({f[50:55] for f in firsts}) == 3


def _packed(model) -> bool:
    return any(getattr(leaf, "dtype", None) == np.uint32 for leaf in jax.tree_util.tree_leaves(model.state))


def test_a_checkpoint_is_benchmarked_with_its_experts_as_serve_loads_them():
    """The demo's experts are dense, as `serve` runs them: without --planes the benchmark keeps them so (a 1-bit
    re-pack made its CPU prefill 1.7x slower than the server's); --planes 1 re-packs them."""
    def model(*flags):
        args = build_parser().parse_args(["--mode", "agents", "--model-dir", str(DEMO_MODEL), "--dtype", "float32",
                                          *flags])
        settle_planes(args)
        return bench_model(args)

    assert not _packed(model()) and not _packed(model("--planes", "0"))
    assert _packed(model("--planes", "1"))


def test_tiny_agents_run_on_the_demo_model(tmp_path, monkeypatch):
    out = tmp_path / "agents.json"
    written = []  # the rows in the JSON file at each write: one write per session count, then the final one
    real_write = bench_main._write_json
    monkeypatch.setattr(bench_main, "_write_json", lambda path, rows: (written.append(len(rows)),
                                                                        real_write(path, rows)))
    argv = ["--mode", "agents", "--sessions", "1,2", "--turns", "1", "--first-turn", "synthetic",
            "--shared-tokens", "48", "--first-tokens", "64,72", "--tool-tokens", "8,12", "--answer-tokens", "4,6",
            "--prefill-chunks", "16,32", "--stagger-s", "0.1", "--share-min-tokens", "16", "--snapshot-every", "32",
            "--trace", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["sessions"] for r in rows] == [1, 2]
    assert written == [1, 2, 2]  # a run cut during the second count would have kept the first's row
    for r in rows:
        assert r["turns"] == 2 and r["ttft_first_p95_s"] > 0 and r["ttft_later_p95_s"] > 0
        assert r["aggregate_tok_s"] > 0 and r["snapshots_taken"] > 0
        assert r["decode_tok_s_otherwise"] > 0
        turns = r["timeline"]
        assert len(turns) == 2 * r["sessions"] and {t["kind"] for t in turns} == {"first", "later"}
        assert all(0 <= t["submitted_s"] < t["first_token_s"] <= t["last_token_s"] for t in turns)
        firsts = [t["first_token_s"] - t["submitted_s"] for t in turns if t["kind"] == "first"]
        answers = [(t["answer_tokens"] - 1) / (t["last_token_s"] - t["first_token_s"]) for t in turns
                   if t["last_token_s"] > t["first_token_s"]]  # each answer's rate, pauses included
        assert r["answer_tok_s"] == pytest.approx(sum(answers) / len(answers), rel=1e-6)
        assert min(firsts) - 1e-9 <= r["ttft_first_p50_s"] <= max(firsts) + 1e-9
        # --trace: the engine's calls. Every prompt token not restored from the cache is prefilled exactly once,
        # in pieces no wider than their call, each call's pieces in distinct slots; steps and snapshots are there.
        prefills = [c for c in r["calls"] if c["kind"] == "prefill"]
        assert sum(end - start for c in prefills for _, start, end, _ in c["pieces"]) == (
            r["prompt_tokens"] - r["prefix_cache_hit_tokens"])
        assert all(0 < end - start <= c["width"] for c in prefills for _, start, end, _ in c["pieces"])
        assert all(len({slot for slot, *_ in c["pieces"]}) == len(c["pieces"]) for c in prefills)
        assert sum(n for n, _ in r["prefill_calls_by_shape"].values()) == len(prefills)
        assert any(c["kind"] == "snapshot" for c in r["calls"])
        assert any(c["kind"] in ("decode", "launch") for c in r["calls"])
        assert all(-0.01 < c["start_s"] < r["wall_s"] and c["seconds"] >= 0 for c in r["calls"])
    assert any(c["kind"] == "restore" for c in rows[1]["calls"])
    # Each later turn resumes its own conversation; the second session resumes the first one's common prefix.
    assert rows[0]["prefix_cache_hit_tokens"] >= 64
    assert rows[1]["prefix_cache_hit_tokens"] >= 2 * 64 + 32


def test_pacings_run_on_one_engine(tmp_path, capsys):
    """Several --mixed-step-ms / --share-by-requests values: every session count under each, one engine (one warm-up),
    each row labelled with the pacing it ran under; a lone session only under the first pacing. With
    --same-conversations every 2-session row has the same prompts, and none reuses another's cached work."""
    out = tmp_path / "agents.json"
    argv = ["--mode", "agents", "--sessions", "1,2", "--turns", "0", "--first-turn", "synthetic", "--shared-tokens",
            "16", "--first-tokens", "40,48", "--answer-tokens", "3,4", "--prefill-chunks", "16", "--together",
            "--decode-share", "0.2", "--mixed-step-ms", "0,1000", "--prefill-burst-ms", "0",
            "--share-by-requests", "off,on", "--same-conversations", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    got = [(r["decode_share"], r["mixed_step_ms"], r["prefill_burst_ms"], r["share_by_requests"], r["sessions"])
           for r in rows]
    assert got == [(0.2, 0, 0, False, 1), (0.2, 0, 0, False, 2), (0.2, 0, 0, True, 2), (0.2, 1000, 0, False, 2),
                   (0.2, 1000, 0, True, 2)]
    captured = capsys.readouterr()
    assert "0.2 by requests" in captured.out and captured.err.count("warm-up: compiling") == 1
    assert all(r["ttft_first_p50_s"] > 0 and r["same_conversations"] for r in rows)
    pairs = {(r["prompt_tokens"], r["prefix_cache_hit_tokens"]) for r in rows[1:]}
    assert len(pairs) == 1, pairs  # the same prompts, and the same cached share: no row resumed another's


def test_each_run_has_its_own_conversations_unless_asked_for_the_same():
    """`run_inputs`: runs of one session count get conversations of their own (no shared first token), or with
    --same-conversations the first such run's, tool results and answer lengths included."""
    from types import SimpleNamespace

    from strata_jax.bench.agents import run_inputs

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=1000), tokenizer=None)
    args = SimpleNamespace(first_turn="synthetic", shared_tokens=50, first_tokens=(60, 80), tool_tokens=(5, 9),
                           answer_tokens=(3, 7), turns=2, same_conversations=False)
    own = run_inputs(args, model, [1, 4, 4, 2, 4], np.random.default_rng(0))
    assert own[1][0][0][0] != own[2][0][0][0] != own[4][0][0][0]  # each run's first turns start their own way
    args.same_conversations = True
    same = run_inputs(args, model, [1, 4, 4, 2, 4], np.random.default_rng(0))
    assert same[1] == same[2] == same[4] and same[0] != same[1] and len(same[3][0]) == 2
    assert len(same[1][0]) == 4 and len(same[1][1]) == 4 and len(same[1][2]) == 4
