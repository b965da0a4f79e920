"""Prompts prefilled together (EngineConfig.prefill_batch): several prompts' pieces in one call, each at its own
position, give every request exactly the tokens it gets alone; a shared call that fails is retried one prompt per
call, so that only the prompt at fault fails."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


@pytest.fixture(scope="module")
def engine(model):
    # No bursts: a prompt short enough to prefill at once beside a decoding slot runs alone, and these tests are
    # about prompts sharing calls whether or not another slot decodes meanwhile.
    eng = Engine(model, EngineConfig(slots=4, max_context=160, prefill_chunks=(8, 32), prefill_batch=4,
                                     prefix_cache_mib=0, prefill_burst_ms=0))
    eng.start()
    yield eng
    eng.shutdown()


def test_the_compiled_prompt_counts_are_powers_of_two():
    assert EngineConfig(slots=8, prefill_batch=4).prefill_batches == (1, 2, 4)
    assert EngineConfig(slots=8, prefill_batch=3).prefill_batches == (1, 2)
    assert EngineConfig(slots=2, prefill_batch=8).prefill_batches == (1, 2)
    assert EngineConfig(slots=4).prefill_batches == (1,)
    with pytest.raises(ValueError, match="prefill_batch"):
        EngineConfig(prefill_batch=0)


def test_prompts_prefilled_together_equal_each_alone(engine, model, monkeypatch):
    # Lengths with pieces of both widths, remainders of different sizes and prompts at different positions.
    prompts = [random_prompt(200 + i, n) for i, n in enumerate((70, 45, 100, 33, 9, 64))]
    before = engine.stats()
    calls_seen = []  # (width, real tokens per prompt) of each prefill call
    real = engine._runner.prefill
    monkeypatch.setattr(engine._runner, "prefill", lambda slots, toks, n_valid, *a, **kw: calls_seen.append(
        (np.asarray(toks).shape[1], [int(n) for n in n_valid])) or real(slots, toks, n_valid, *a, **kw))

    async def run():
        return await asyncio.gather(*[collect(engine, p, max_tokens=6) for p in prompts])

    results = asyncio.run(run())
    for p, events in zip(prompts, results):
        assert tokens(events) == greedy(model, p, 6)
        assert events[-1].finish_reason == "length"
    after = engine.stats()
    pieces = after["prefill_chunks_total"] - before["prefill_chunks_total"]
    calls = after["prefill_calls_total"] - before["prefill_calls_total"]
    assert calls < pieces  # some calls really ran several prompts
    # ... and pieces of both widths together: a 32-wide call carrying a piece of at most 8 tokens
    assert any(width == 32 and len(n) > 1 and min(n) <= 8 for width, n in calls_seen), calls_seen


def test_a_call_takes_the_next_prompts_whatever_their_pieces_widths():
    """The grouping rule alone: the first prompt in the order and the next ones (a compiled power-of-two count, none
    that must prefill alone), not only those whose pieces take the first one's width."""
    from types import SimpleNamespace

    from strata_jax.engine.scheduler import Scheduler

    jobs = [SimpleNamespace(prefill_alone=False, name=i) for i in range(4)]
    stub = SimpleNamespace(config=EngineConfig(slots=4, prefill_batch=4))
    assert [j.name for j in Scheduler._prefill_group(stub, jobs, 4)] == [0, 1, 2, 3]
    assert [j.name for j in Scheduler._prefill_group(stub, jobs[:3], 4)] == [0, 1]  # compiled counts 1, 2, 4
    assert [j.name for j in Scheduler._prefill_group(stub, jobs, 1)] == [0]  # a mixed shape of one prompt
    jobs[1].prefill_alone = True
    assert [j.name for j in Scheduler._prefill_group(stub, jobs, 4)] == [0, 2]
    jobs[0].prefill_alone = True
    assert [j.name for j in Scheduler._prefill_group(stub, jobs, 4)] == [0]


def test_sampled_output_does_not_depend_on_the_prompts_beside_it(engine):
    p = random_prompt(230, 50)
    alone = asyncio.run(collect(engine, p, max_tokens=8, temperature=1.0, seed=11))

    async def crowded():
        return await asyncio.gather(collect(engine, p, max_tokens=8, temperature=1.0, seed=11),
                                    collect(engine, random_prompt(231, 50), max_tokens=8, temperature=0.8, seed=2),
                                    collect(engine, random_prompt(232, 50), max_tokens=8))

    assert tokens(asyncio.run(crowded())[0]) == tokens(alone)


def test_a_failed_shared_prefill_fails_only_the_prompt_at_fault(engine, model, monkeypatch):
    runner = engine._runner
    bad = random_prompt(240, 40)
    good = [random_prompt(241, 40), random_prompt(242, 72)]
    real = runner.prefill
    shared_failures = []

    def prefill(slots, tokens_, *args, **kw):
        if any(tuple(int(t) for t in row[:8]) == bad[:8] for row in np.asarray(tokens_)):
            shared_failures.append(len(slots))
            raise RuntimeError("injected failure of one prompt's inputs")
        return real(slots, tokens_, *args, **kw)

    monkeypatch.setattr(runner, "prefill", prefill)

    async def run():
        return await asyncio.gather(*[collect(engine, p, max_tokens=5) for p in (good[0], bad, good[1])])

    first, failed, second = asyncio.run(run())
    assert failed[-1].finish_reason == "error" and "injected" in failed[-1].error
    for p, events in ((good[0], first), (good[1], second)):
        assert tokens(events) == greedy(model, p, 5)
        assert events[-1].finish_reason == "length"
    assert shared_failures[-1] == 1 and max(shared_failures) > 1  # failed shared, then alone
