"""Log-probabilities computed in the step: each emitted token's logprob and its top alternatives equal a numpy
log_softmax of the model's own logits (`LoadedModel.logits`), with plain decode and through verify windows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.engine import Engine, EngineConfig

CTX = 96


class PerfectDrafter:
    """Guesses the true greedy continuation (drafts accepted: verify windows emit several tokens at once), but
    every third guess ends with a wrong token (a rejection)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int):
        self.answers, self.k, self.calls = answers, k, 0

    def propose(self, requests):
        return {slot: self._guess(r.history, r.limit) for slot, r in requests.items()}

    def warm_up(self):
        pass

    def _guess(self, history, limit):
        self.calls += 1
        for prompt, answer in self.answers.items():
            if tuple(history[: len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                guess = list(answer[done : done + min(self.k, limit)])
                if guess and self.calls % 3 == 0:
                    guess[-1] = (guess[-1] + 1) % 500
                return guess
        return []


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


@pytest.fixture(scope="module")
def engine(model):
    """One engine for both cases (its steps compile once): its PerfectDrafter guesses only for the prompts in its
    `answers`, which a test without speculation leaves empty (no drafts: plain decode steps only)."""
    cfg = EngineConfig(slots=2, max_context=CTX, prefill_chunks=(8, 32), prefix_cache_mib=0)
    eng = Engine(model, cfg, drafter=PerfectDrafter({}, cfg.draft_k))
    eng.start()
    yield eng
    eng.shutdown()


def _reference(model, prompt, generated) -> np.ndarray:
    """log_softmax of the model's logits at every generated token's position [len(generated), V]."""
    seq = np.asarray([list(prompt) + list(generated)], np.int32)
    logits = np.asarray(model.logits(seq)[0, len(prompt) - 1 : len(seq[0]) - 1], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _check(model, prompt, events, k):
    generated = tokens(events)
    ref = _reference(model, prompt, generated)
    lps = [lp for ev in events for lp in ev.logprobs]
    assert len(lps) == len(generated)
    for i, (token, lp) in enumerate(zip(generated, lps)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[i, token], abs=2e-3)
        assert len(lp.top) == k
        want = np.argsort(-ref[i], kind="stable")[:k]
        assert [v for _, v in lp.top] == pytest.approx(list(ref[i, want]), abs=2e-3)
        # ids can swap only between (numerically) tied values
        for (tid, v), w in zip(lp.top, want):
            assert tid == w or abs(ref[i, tid] - ref[i, w]) < 2e-3


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_match_numpy_log_softmax(engine, model, speculative):
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((5, 23, 11))]
    answers = {p: greedy(model, p, 10) for p in prompts}
    drafter = engine._scheduler.drafter
    drafter.answers, drafter.calls = (answers if speculative else {}), 0
    before = engine.stats()
    try:
        async def run():
            return await asyncio.gather(
                collect(engine, prompts[0], max_tokens=10, logprobs=5),
                collect(engine, prompts[1], max_tokens=10, logprobs=0),
                collect(engine, prompts[2], max_tokens=10))  # no logprobs asked: none given

        with_5, with_0, without = asyncio.run(run())
        stats = {k: v - before[k] for k, v in engine.stats().items() if k.endswith("_total")}
    finally:
        drafter.answers = {}
    for p, events in zip(prompts, (with_5, with_0, without)):
        assert tokens(events) == answers[p]  # greedy output unchanged
    _check(model, prompts[0], with_5, 5)
    _check(model, prompts[1], with_0, 0)
    assert all(ev.logprobs == () for ev in without)
    if speculative:
        assert stats["accepted_draft_tokens_total"] > 0 and stats["verify_steps_total"] > 0
    else:
        assert stats["verify_steps_total"] == 0  # plain decode steps only
