"""Longer and adaptive drafts: the per-slot draft-length policy on its own (no model), the per-drafter limits, and
greedy output with drafts of up to 8 tokens (16 for n-gram), adaptive lengths on and off, equal to plain greedy
decoding (LoadedModel's step API, which runs no engine: engine_helpers.greedy)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import greedy
from strata_jax.bench.oracle import OracleDrafter
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine import draft_policy
from strata_jax.engine.draft_policy import DraftLengths, best_length


# -- the policy, without a model ----------------------------------------------------------------------------------
def test_best_length_is_the_longest_whose_last_draft_is_worth_min_gain():
    lengths = (1, 2, 4, 8, 16)
    for p in np.linspace(0.0, 1.0, 101):
        # Independent of best_length's logarithms: count up while p^k stays above the threshold.
        worth = [k for k in lengths if p**k >= draft_policy.MIN_GAIN - 1e-12]
        assert best_length(float(p), lengths) == (max(worth) if worth else 0), p
    assert best_length(0.75, (1, 2, 3, 5)) == 3  # 0.75^4 < 0.25 <= 0.75^3; 5 is out of reach
    assert best_length(1.0, (1, 4)) == 4


def test_lengths_grow_with_acceptance_shrink_with_misses_and_pause():
    policy = DraftLengths((1, 2, 4, 8))
    owner = object()
    assert policy.length(0, owner) == 4  # the prior: p = 0.75
    for _ in range(2):  # misses: shorter drafts
        policy.update(0, 4, 0)
        assert policy.length(0, owner) == 1
    policy.update(0, 1, 0)  # the third miss in a row: decode plainly for PAUSE_STEPS steps
    # `paused` says so ahead of each step (the engine may then overlap it) without counting the pause down.
    ahead = []
    for _ in range(draft_policy.PAUSE_STEPS):
        ahead.append(policy.paused(0, owner) and policy.paused(0, owner))
        assert policy.length(0, owner) == 0
    assert ahead == [True] * draft_policy.PAUSE_STEPS
    assert not policy.paused(0, owner) and not policy.paused(0, object())  # a new request starts at the prior
    assert policy.length(0, owner) == 1  # then try again with the shortest draft
    seen = []
    for _ in range(4):  # every draft accepted: longer drafts, up to the longest compiled
        k = policy.length(0, owner)
        policy.update(0, k, k)
        seen.append(policy.length(0, owner))
    assert seen == sorted(seen) and seen[-1] == 8 and seen[0] < 8
    # The estimate is successes / (successes + failures) with both decayed per window.
    hits, misses = 1.5, 0.5
    policy = DraftLengths((1, 2, 4))
    policy.length(3, owner)
    for proposed, accepted in [(4, 2), (2, 2), (4, 0), (1, 1)]:
        policy.update(3, proposed, accepted)
        hits = draft_policy.DECAY * hits + accepted
        misses = draft_policy.DECAY * misses + (accepted < proposed)
    assert math.isclose(policy.acceptance(3), hits / (hits + misses))


def test_a_new_request_in_a_slot_starts_from_the_prior():
    policy = DraftLengths((1, 2, 4))
    first, second = object(), object()
    policy.length(0, first)
    for _ in range(3):
        policy.update(0, 4, 0)
    assert policy.length(0, first) == 0
    assert policy.length(0, second) == 4
    assert policy.length(1, first) == 4  # slots are independent


def test_draft_limits_are_per_drafter():
    assert EngineConfig(draft="ngram", draft_k=16).verify_widths == (2, 3, 5, 9, 17)
    assert EngineConfig(draft="ngram", draft_k=16, adaptive_draft=False).verify_widths == (17,)
    assert EngineConfig(draft="mtp", draft_k=8).draft_ks == (1, 2, 4, 8)
    assert EngineConfig(draft="mtp", draft_k=5).draft_ks == (1, 2, 4, 5)
    assert EngineConfig(draft_k=16).draft_k == 16  # a drafter passed to the Engine (draft="none")
    with pytest.raises(ValueError, match=r"draft_k must be in 1\.\.16 for draft='ngram', got 17"):
        EngineConfig(draft="ngram", draft_k=17)
    with pytest.raises(ValueError, match=r"draft_k must be in 1\.\.8 for draft='mtp', got 9"):
        EngineConfig(draft="mtp", draft_k=9)
    with pytest.raises(ValueError, match=r"1\.\.16"):
        EngineConfig(draft_k=0)


# -- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


def _run(engine, prompts, max_tokens):
    async def one(p):
        stream = await engine.submit(GenerationRequest(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        return [ev.token_id async for ev in stream if ev.token_id is not None]

    async def all_():
        return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(all_())


def _serve(model, cfg, prompts, max_tokens, drafter=None):
    """(outputs, stats, verify widths run) of an engine over `prompts`."""
    eng = Engine(model, cfg, drafter=drafter)
    widths = []
    verify = eng._runner.verify

    def spy(tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return verify(tokens, *args, **kwargs)

    eng._runner.verify = spy
    eng.start()
    try:
        return _run(eng, prompts, max_tokens), eng.stats(), widths
    finally:
        eng.shutdown()


def _replayed(model, cfg, p, seed, lengths, max_tokens):
    """(plain greedy outputs, the engine's outputs, stats, verify widths) for random prompts of `lengths`, drafted
    by a replay of the greedy answers with each draft right with probability `p`."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(x) for x in rng.integers(0, 500, n)) for n in lengths]
    want = [greedy(model, q, max_tokens) for q in prompts]
    drafter = OracleDrafter([q + tuple(w) for q, w in zip(prompts, want)], p, model.config.vocab_size, seed=seed)
    return (want, *_serve(model, cfg, prompts, max_tokens, drafter))


def test_eight_drafts_adaptive_equal_plain_greedy(model):
    # A replay of the right answers, 90% of drafts right: lengths grow to 8 and fall back after misses.
    # One prefill width: the verify widths are what this test compiles for.
    cfg = EngineConfig(slots=2, max_context=96, prefill_chunks=(32,), prefix_cache_mib=0, draft_k=8)
    want, got, stats, widths = _replayed(model, cfg, 0.9, 3, (19, 33), 30)
    assert got == want
    assert 0 < stats["accepted_draft_tokens_total"] < stats["draft_tokens_total"]
    assert set(widths) <= set(cfg.verify_widths) and 9 in widths and len(set(widths)) >= 2


def test_sixteen_ngram_drafts_equal_plain_greedy(model):
    # A prompt that repeats itself: prompt lookup drafts 16 tokens at every step (mostly wrong on a random model).
    base = tuple(int(x) for x in np.random.default_rng(4).integers(0, 500, 20))
    prompts = [base * 3, base[5:] * 2]
    want = [greedy(model, p, 12) for p in prompts]
    fixed = EngineConfig(slots=2, max_context=128, prefill_chunks=(64,), prefix_cache_mib=0, draft="ngram",
                         draft_k=16, adaptive_draft=False)
    got, stats, widths = _serve(model, fixed, prompts, 12)
    assert got == want and set(widths) == {17} and stats["draft_tokens_total"] > 0


def test_paused_slots_decode_overlapped_and_equal_plain_greedy():
    """A drafter that is always wrong: each slot pauses after three missed windows, and while every decoding slot
    is paused the engine overlaps its decode steps (as with no drafter); the output is plain greedy's. (qwen3_next:
    a model with PLE never overlaps, its next rows need the tokens on the host.)"""
    model = strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next")
    cfg = EngineConfig(slots=2, max_context=96, prefill_chunks=(32,), prefix_cache_mib=0, draft_k=2)
    want, got, stats, _ = _replayed(model, cfg, 0.0, 6, (17, 25), 40)
    assert got == want
    assert stats["verify_steps_total"] > 0 and stats["accepted_draft_tokens_total"] == 0
    assert stats["overlapped_steps_total"] > 0
    # Verify windows chained on the device (the oracle guesses there too) or, near a request's end and around a
    # pause's ends, ran in step with the host; the paused decode steps overlapped.
    in_step_windows = stats["verify_steps_total"] - stats["chained_windows_total"]
    assert stats["chained_windows_total"] > 0 and in_step_windows >= 0
    assert in_step_windows <= stats["in_step_steps_total"] < in_step_windows + stats["decode_steps_total"]
