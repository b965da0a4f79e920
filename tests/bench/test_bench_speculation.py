"""Speculation measured at real shapes: the benchmark-only oracle drafter (`--draft oracle:P`) accepts about P of
its drafts (against a simulated greedy verifier, and through the real engine on a tiny model), and the synthetic
preset's MTP head and PLE layer run through the step and users benchmarks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata_jax.bench.main import main
from strata_jax.bench.oracle import OracleDrafter, oracle_label, parse_oracle
from strata_jax.bench.synthetic import PLE_PARTS, preset_config
from strata_jax.engine.drafters import DraftRequest
from strata_jax.model.ple_hash import NgramHasher


def _simulate(drafter: OracleDrafter, records, k: int) -> None:
    """Greedy verification as the engine does it, in Python: a window keeps the longest prefix of drafts equal to
    the recorded answer, then the answer's own next token."""
    for owner, record in enumerate(records):
        n = 10  # the prompt
        while n < len(record) - 1:
            drafts = drafter.propose({0: DraftRequest(owner, record[:n], min(k, len(record) - n - 1))})[0]
            kept = 0
            while kept < len(drafts) and drafts[kept] == record[n + kept]:
                kept += 1
            n += kept + 1
        drafter.propose({0: DraftRequest(owner, record[:n], 0)})  # lets it see the last window


@pytest.mark.parametrize("p", [0.0, 0.5, 0.75, 0.95])
def test_oracle_drafts_are_right_with_probability_p(p):
    rng = np.random.default_rng(0)
    records = [tuple(int(t) for t in rng.integers(0, 300, 410)) for _ in range(40)]
    drafter = OracleDrafter(records, p, vocab_size=300, seed=3)
    _simulate(drafter, records, k=4)
    c = drafter.counts
    seen = c["accepted"] + c["rejections"]
    assert seen > 3000 and c["diverged"] == 0
    # Binomial(seen, p): 5 standard deviations
    assert abs(drafter.per_draft_acceptance() - p) <= 5 * np.sqrt(p * (1 - p) / seen) + 1e-9
    assert c["planted"] <= c["proposed"]


def test_oracle_is_seeded_per_request_and_position_and_stops_where_the_output_leaves_the_record():
    records = [tuple(range(100, 140)), tuple(range(200, 240))]
    a = OracleDrafter(records, 0.5, vocab_size=1000, seed=7)
    b = OracleDrafter(records[::-1], 0.5, vocab_size=1000, seed=7)
    # The same request at the same position gets the same drafts, whatever else the drafter saw before.
    b.propose({1: DraftRequest("x", records[1][:12], 6)})
    first = a.propose({0: DraftRequest("r", records[0][:10], 6)})[0]
    again = b.propose({0: DraftRequest("r", records[0][:10], 6)})[0]
    assert len(first) == 6 and all(0 <= t < 1000 for t in first)
    assert [t == r for t, r in zip(first, records[0][10:16])] == [t == r for t, r in zip(again, records[0][10:16])]
    # An output that departs from the record gets no more drafts (and is counted).
    off = list(records[0][:12])
    off[11] = 7
    assert a.propose({0: DraftRequest("r", off, 6)}) == {0: []} and a.counts["diverged"] == 1
    assert a.propose({0: DraftRequest("unknown", (1, 2, 3), 6)}) == {0: []} and a.counts["diverged"] == 2
    assert a.diverged_at == [11, 3]  # where each left its record: the changed token, and before any token
    # `record` starts over: new records, no replays, fresh counts; an oracle without records drafts nothing.
    empty = OracleDrafter([], 0.5, vocab_size=1000)
    assert empty.propose({0: DraftRequest("r", records[0][:10], 6)}) == {0: []}
    empty.record(records)
    assert empty.counts["diverged"] == 0 and empty.diverged_at == []
    assert len(empty.propose({0: DraftRequest("r", records[0][:10], 6)})[0]) == 6


def test_oracle_spec_parsing():
    assert parse_oracle("oracle:0.75") == 0.75 and parse_oracle("ngram") is None
    assert oracle_label(0.75) == "oracle P=0.75"
    for bad in ("oracle:x", "oracle:1.5", "oracle:-0.1"):
        with pytest.raises(ValueError, match="oracle"):
            parse_oracle(bad)
    with pytest.raises(SystemExit):
        main(["--mode", "users", "--preset", "tiny", "--draft", "oracle:2"])


def test_flash_next_ple_has_the_real_row_width_and_a_scaled_table():
    cfg = preset_config("flash-next-125b", ple=True)
    assert cfg.ple_layers == (1,) and cfg.layer_is_linear(1)  # one-indexed layer 2, a Gated DeltaNet layer
    assert cfg.ple_ngram_heads == 16 and cfg.ple_embed_dim // cfg.ple_ngram_heads == 160
    assert PLE_PARTS["flash-next-125b"]["ngram_vocab_size_base"] == 20_000_000  # the real rows per head
    rows = NgramHasher.for_layer(cfg, 0).table_rows
    assert 16 * 262_144 <= rows < 16 * 262_144 + 16 * 1000  # 16 primes just above 262,143, padded to 128
    assert preset_config("flash-next-125b").ple_layers == ()  # other modes keep the preset without PLE


def test_oracle_through_the_engine_accepts_about_p(tmp_path):
    """In bfloat16, as on the GPU: a plain random model's replay left its record within ~30 tokens here (and at the
    4th on the H200), since verify windows and decode steps pick different greedy tokens among near-tied logits; the
    oracle's runs use a model whose greedy answer is a fixed permutation chain (`make_greedy_chain`)."""
    out = tmp_path / "users.json"
    assert main(["--mode", "users", "--preset", "tiny", "--dtype", "bfloat16", "--users", "2", "--prompt-tokens",
                 "16", "--gen-tokens", "64", "--prefill-chunks", "16", "--draft", "oracle:0.75", "--draft-k", "4",
                 "--no-mtp", "--no-ple", "--bandwidth-gib", "0.01", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    perm = np.random.default_rng(0).permutation(preset_config("tiny").vocab_size)
    for answer in rows[0]["outputs"]:  # the "none" row: each greedy token is perm[the one before]
        assert len(answer) == 64 and all(perm[a] == b for a, b in zip(answer, answer[1:]))
    oracle = [r for r in rows if r["speculation"] == "oracle P=0.75"]
    assert len(oracle) == 1 and oracle[0]["oracle_diverged"] == 0  # the replay followed the greedy answers
    assert oracle[0]["oracle_diverged_at"] == [] and oracle[0]["oracle_record_is_none_rows"]  # recorded by its engine
    measured = oracle[0]["oracle_per_draft_acceptance"]
    assert abs(measured - 0.75) < 0.17  # ~110 drafts checked: 4 standard deviations
    assert 0 < oracle[0]["acceptance"] < measured  # drafts after a rejection count as drafted, not accepted
    # Where a speculative step's time goes: verify windows chained on the device (the rest, near each answer's end,
    # in step with the host: the runner's call inside the engine's step), and at P = 0.75 more than one draft kept
    # per verify step and well under every draft (two slots of up to 4 drafts each, 2.05 kept per slot expected at
    # k = 4; 8 would mean every draft right).
    o = oracle[0]
    assert 0 < o["chained_windows"] < o["verify_steps"] and o["launch_ms_per_step"] > 0
    assert o["in_step_steps"] >= o["verify_steps"] - o["chained_windows"] > 0
    assert 0 < o["in_step_call_ms_per_step"] < o["in_step_ms_per_step"]
    assert 1.0 < o["accepted_per_verify"] < 6.0
    assert rows[0]["overlapped_steps"] > 0 and rows[0]["in_step_steps"] < rows[0]["decode_steps"]


def test_step_mode_runs_the_mtp_head_and_gathers_ple_rows(tmp_path):
    out = tmp_path / "step.json"
    assert main(["--mode", "step", "--preset", "tiny", "--slots", "2", "--verify-slots", "2", "--ctx", "64",
                 "--fill", "32", "--steps", "2", "--draft-k", "3", "--mtp", "--ple", "--ple-rows-per-head", "4096",
                 "--bandwidth-gib", "0.01", "--json", str(out)]) == 0
    rows = {r["kind"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"decode", "verify", "mtp"}
    assert rows["verify"]["mtp_k"] == 3 and rows["mtp"]["mtp_k"] == 3 and rows["decode"]["mtp_k"] == 0
    assert rows["decode"]["ple"] and rows["decode"]["ple_host_ms"] > 0 and rows["verify"]["ple_host_ms"] > 0
    assert rows["mtp"]["kernels"] > 0 and rows["mtp"]["device_ms"] > 0 and "mtp_over_decode" in rows["mtp"]
    assert main(["--mode", "step", "--preset", "tiny", "--slots", "1", "--verify-slots", "", "--ctx", "64",
                 "--fill", "32", "--steps", "1", "--no-mtp", "--no-ple", "--bandwidth-gib", "0.01",
                 "--json", str(out)]) == 0
    plain = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in plain] == ["decode"] and plain[0]["ple_host_ms"] is None and not plain[0]["ple"]
    with pytest.raises(SystemExit):
        main(["--mode", "step", "--preset", "tiny", "--mtp", "--draft-k", "9"])  # the MTP head chains at most 8


def test_users_mode_drafts_with_the_synthetic_mtp_head_and_ple(tmp_path):
    out = tmp_path / "users.json"
    assert main(["--mode", "users", "--preset", "tiny", "--dtype", "float32", "--users", "2", "--prompt-tokens",
                 "16", "--gen-tokens", "12", "--prefill-chunks", "16", "--draft", "mtp", "--draft-k", "2",
                 "--mtp", "--ple", "--ple-rows-per-head", "4096", "--bandwidth-gib", "0.01", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["speculation"] for r in rows] == ["none", "mtp"]
    assert rows[1]["acceptance"] is not None  # the MTP head drafted (random weights: rarely right)
