"""Speculative decoding: the acceptance rule keeps the target distribution, greedy output with speculation equals
output without, for the n-gram, MTP and draft-model drafters. (A replayed, often-right drafter with adaptive lengths
up to 8: tests/engine/test_adaptive_draft.py.)"""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import greedy
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine.drafters import NgramDrafter
from strata_jax.engine.speculative import accept


def _accept_many(logits, drafts, n_drafts, temperature, seeds):
    """accept() for one slot under many seeds (vectorised over the seed)."""
    s = len(seeds)
    tile = lambda x: jnp.broadcast_to(x, (s,) + x.shape[1:])  # noqa: E731
    return jax.jit(accept)(
        tile(logits), tile(drafts), tile(n_drafts), jnp.full((s,), temperature, jnp.float32),
        jnp.zeros((s,), jnp.int32), jnp.ones((s,), jnp.float32), jnp.asarray(seeds, jnp.uint32),
        jnp.zeros((s,), jnp.int32),
    )


@pytest.mark.parametrize("draft", [0, 3])  # a likely and an unlikely guess
def test_sampled_acceptance_keeps_the_target_distribution(draft):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 3, 5)) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(logits[0], axis=-1))
    n = 40000
    n_acc, tokens = _accept_many(logits, jnp.asarray([[draft, 1]]), jnp.asarray([2]), 1.0, np.arange(n))
    n_acc, tokens = np.asarray(n_acc), np.asarray(tokens)
    first = np.bincount(tokens[:, 0], minlength=5) / n
    assert np.max(np.abs(first - p[0])) < 0.012
    # Given the first draft was accepted, the second emitted token follows the target's next distribution.
    second = tokens[n_acc >= 1, 1]
    assert np.max(np.abs(np.bincount(second, minlength=5) / len(second) - p[1])) < 0.02
    assert abs(np.mean(n_acc >= 1) - p[0, draft]) < 0.012


def test_greedy_acceptance_is_the_longest_matching_prefix():
    logits = jax.nn.one_hot(jnp.asarray([[2, 4, 1, 0]]), 5) * 5.0
    n_acc, tokens = _accept_many(logits, jnp.asarray([[2, 4, 3]]), jnp.asarray([3]), 0.0, [0])
    assert int(n_acc[0]) == 2 and list(np.asarray(tokens[0, :3])) == [2, 4, 1]
    n_acc, tokens = _accept_many(logits, jnp.asarray([[2, 4, 3]]), jnp.asarray([1]), 0.0, [0])
    assert int(n_acc[0]) == 1 and list(np.asarray(tokens[0, :2])) == [2, 4]


def test_ngram_drafter_continues_the_latest_match():
    d = NgramDrafter(k=3)
    assert d.propose_one([5, 6, 7, 8, 1, 5, 6, 7], 10) == [8, 1, 5]
    assert d.propose_one([5, 6, 7, 8, 1, 5, 6, 7], 2) == [8, 1]
    assert d.propose_one([1, 2, 3], 4) == []
    assert d.propose_one([9, 1, 2, 9, 3, 9], 4) == [3, 9]  # longest n first, then the latest occurrence


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


def _run(engine, prompts, max_tokens, **sampling):
    async def one(p):
        stream = await engine.submit(GenerationRequest(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                          **sampling)))
        return [ev async for ev in stream]

    async def all_():
        return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(all_())


def _check_equal(model, prompts, cfg, drafter, max_tokens=12):
    eng = Engine(model, cfg, drafter=drafter)
    eng.start()
    try:
        return _check_run(model, eng, prompts, max_tokens)
    finally:
        eng.shutdown()


def _check_run(model, eng, prompts, max_tokens):
    """Runs `prompts` through the started engine `eng`: every output equals plain greedy decoding, verify steps ran
    and the requests' draft counts add up to the engine's; returns the counters this run added."""
    want = {p: greedy(model, p, max_tokens) for p in prompts}
    before = eng.stats()
    results = _run(eng, prompts, max_tokens)
    for p, events in zip(prompts, results):
        assert [e.token_id for e in events] == want[p]
    after = eng.stats()
    stats = {k: v - before[k] for k, v in after.items() if k.endswith("_total")}
    assert stats["verify_steps_total"] > 0
    assert sum(ev[-1].draft_tokens for ev in results) == stats["draft_tokens_total"] > 0
    assert sum(ev[-1].accepted_draft_tokens for ev in results) == stats["accepted_draft_tokens_total"]
    # Verify windows run in step with the host (plain decode steps too, unless every slot's drafts are paused):
    # each is one runner call timed inside the engine thread's whole step.
    assert stats["verify_steps_total"] <= stats["in_step_steps_total"] <= (
        stats["verify_steps_total"] + stats["decode_steps_total"] - stats["overlapped_steps_total"])
    assert 0 < stats["in_step_call_seconds_total"] < stats["in_step_seconds_total"]
    return stats


def test_greedy_output_with_ngram_drafts_equals_without(model):
    # Every token id appears in the prompts, so the 1-gram lookup drafts at every step (and is mostly wrong on a
    # random model): many verify windows, many rollbacks, rows of different lengths.
    perm = np.random.default_rng(5).permutation(500)
    prompts = [tuple(int(x) for x in perm[:120]), tuple(int(x) for x in perm[120:])[:130], tuple(range(60))]
    cfg = EngineConfig(slots=2, max_context=160, prefill_chunks=(16,), prefix_cache_mib=0, draft="ngram")
    stats = _check_equal(model, prompts, cfg, None, max_tokens=10)
    # Drafts exist at every step, so plain decode steps only happen when missing drafts were paused (adaptive).
    assert stats["decode_steps_total"] > 0


@pytest.mark.parametrize("name", ["qwen4_exp_causal", "qwen3_next"])
def test_mtp_drafting_is_exact_and_drafts_match_the_mtp_head(name):
    model = strata_jax.load_model(FIXTURES / "ckpt" / name)
    rng = np.random.default_rng(9)
    prompts = [tuple(int(x) for x in rng.integers(0, 500, n)) for n in (21, 9, 40)]
    # Every compiled step chains the MTP head (the costliest compiles of the suite), so as few as cover it: one
    # prefill width (prompts still span several chunks, padded and whole) and one verify width (drafts of a fixed
    # length; adaptive lengths, the same for every drafter, are tests/engine/test_adaptive_draft.py's).
    cfg = EngineConfig(slots=2, max_context=96, prefill_chunks=(8,), prefix_cache_mib=0, draft="mtp", draft_k=3,
                       adaptive_draft=False)
    eng = Engine(model, cfg)
    seen = []
    real_prefill = eng._runner.prefill

    def spy(*args, **kwargs):
        out = real_prefill(*args, **kwargs)
        seen.append((int(out.tokens[0]), list(out.drafts[0])))
        return out

    eng._runner.prefill = spy
    eng.start()
    try:
        results = _run(eng, prompts, 10)
    finally:
        eng.shutdown()
    for p, events in zip(prompts, results):
        assert [e.token_id for e in events] == greedy(model, p, 10)
    assert eng.stats()["verify_steps_total"] > 0
    # The first MTP guess after a prompt, recomputed through the plain API: MTP(hidden of each prompt token,
    # the token after it), read at the last prompt token.
    p = prompts[0]
    seqs = model.start(1, 160)  # greedy's shapes above: its compiled prefill
    logits, hidden, seqs = model.step(seqs, np.asarray([p]))
    first = int(np.argmax(logits[0, -1]))
    mtp_logits, _ = model.mtp_step(seqs, np.asarray([p[1:] + (first,)]), hidden)
    final = [s for s in seen if s[0] == first]
    assert final and final[0][1][0] == int(np.argmax(mtp_logits[0, -1]))


def test_draft_model_drafting_is_exact():
    from strata_jax.engine.draft_model import DraftModelDrafter

    target = strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next")
    rng = np.random.default_rng(4)
    prompts = [tuple(int(x) for x in rng.integers(0, 500, n)) for n in (30, 7, 45)]
    # One prefill width (the target's and both draft models' prefill steps each compile once per width): the
    # draft models still catch up on several chunks per prompt and on a few tokens after each verify.
    cfg = EngineConfig(slots=2, max_context=96, prefill_chunks=(8,), prefix_cache_mib=0, draft_k=3)
    # The target as its own draft model: every draft is right, so whole windows are accepted.
    drafter = _Swappable(DraftModelDrafter(strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next"), cfg,
                                           target.config.vocab_size))
    eng = Engine(target, cfg, drafter=drafter)  # one engine for both draft models: the target compiles once
    eng.start()
    try:
        stats = _check_run(target, eng, prompts, 10)
        assert stats["accepted_draft_tokens_total"] == stats["draft_tokens_total"]
        # A different model as the drafter: mostly wrong, still exact.
        other = DraftModelDrafter(strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next", dtype="bfloat16"), cfg,
                                  target.config.vocab_size)
        other.warm_up()
        drafter.inner = other
        stats = _check_run(target, eng, prompts, 10)
        assert stats["accepted_draft_tokens_total"] < stats["draft_tokens_total"]
    finally:
        eng.shutdown()


class _Swappable:
    """A drafter that hands every call to `inner`, which the test replaces between runs of one engine."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, requests):
        return self.inner.propose(requests)

    def warm_up(self):
        self.inner.warm_up()
