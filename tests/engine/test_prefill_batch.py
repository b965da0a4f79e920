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


# Warm-up's call times on an H100 (Flash-Next, 2026-12-07): (step, width, prompts) -> seconds.
H100_SECONDS = {("prefill", 256, 1): 0.040, ("prefill", 256, 2): 0.069, ("prefill", 256, 4): 0.090,
                ("prefill", 1024, 1): 0.083, ("prefill", 1024, 2): 0.144, ("prefill", 1024, 4): 0.261,
                ("prefill", 4096, 1): 0.258, ("prefill", 4096, 2): 0.498, ("prefill", 4096, 4): 0.953}


def _pieces(remaining, widths=(256, 1024, 4096)):
    return {w: [min(r, w) for r in remaining] for w in widths}


def test_a_call_takes_the_shape_that_moves_the_most_prompt_tokens_per_second():
    """`fastest_call`: four agents' last pieces after their shared prefix (measured: a 4,096 x 4 call of them took
    as long as a full one) go 1,024 wide; full pieces stay in the widest call, as do near ties; short rests take
    narrow calls; a shape warm-up did not time is never chosen."""
    from strata_jax.engine.prefill_policy import fastest_call

    assert fastest_call(_pieces([745, 1027, 1221, 2718]), (1, 2, 4), H100_SECONDS) == (1024, 4)
    assert fastest_call(_pieces([9000, 9200, 9400, 10900]), (1, 2, 4), H100_SECONDS) == (4096, 4)
    assert fastest_call(_pieces([3000] * 4), (1, 2, 4), H100_SECONDS) == (4096, 4)  # 1,024 x 4 only 1.25x
    assert fastest_call(_pieces([3, 197]), (1, 2), H100_SECONDS) == (256, 2)
    assert fastest_call(_pieces([1694]), (1,), H100_SECONDS) == (1024, 1)
    assert fastest_call(_pieces([5000]), (1,), H100_SECONDS) == (4096, 1)
    # Two short rests beside two long ones: all four in the widest call (no narrower call is clearly faster).
    assert fastest_call(_pieces([40, 60, 4096, 4096]), (1, 2, 4), H100_SECONDS) == (4096, 4)
    untimed = {k: v for k, v in H100_SECONDS.items() if k[1] != 1024}  # only 256 and 4,096 were timed
    assert fastest_call(_pieces([745, 1027, 1221, 2718]), (1, 2, 4), untimed) == (256, 4)
    assert fastest_call(_pieces([745]), (1,), {}) is None


def test_pieces_start_where_the_slot_cache_ends_and_the_call_shape_follows_them():
    """After a prefix restored at 16,000 tokens, the next piece is a full 4,096 (a grid would cut 384 first); the
    scheduler's call for four such prompts near their ends takes the 1,024-wide shape for all four."""
    from types import SimpleNamespace

    from strata_jax.engine.executor import StepExecutor
    from strata_jax.engine.prefill_policy import PrefillPolicy
    from strata_jax.engine.scheduler import Scheduler

    config = EngineConfig(slots=4, prefill_chunks=(256, 1024, 4096), prefill_batch=4)
    executor = SimpleNamespace(config=config)
    executor._piece_end = lambda job, limit=None: StepExecutor._piece_end(executor, job, limit)
    executor.piece_length = lambda job, limit=None: StepExecutor.piece_length(executor, job, limit)
    job = SimpleNamespace(pos=16000, fill=range(24937), snapshot_at=set())
    assert executor.piece_length(job) == 4096 and executor.piece_length(job, 1024) == 1024
    job.snapshot_at.add(18000)  # a parting point: a snapshot is due there
    assert executor.piece_length(job) == 2000
    policy = PrefillPolicy(config)
    stub = SimpleNamespace(config=config, executor=executor, policy=policy)
    ends = [24937, 25219, 25413, 26910]
    group = [SimpleNamespace(pos=24192, fill=range(n), snapshot_at=set()) for n in ends]
    assert Scheduler._prefill_call(stub, group, 4096) == (group, 4096)  # before warm-up: the whole group, widest
    policy.warmed_up(H100_SECONDS)
    assert Scheduler._prefill_call(stub, group, 4096) == (group, 1024)
    assert Scheduler._prefill_call(stub, group[:1], 4096) == (group[:1], 1024)  # 745 tokens alone (a burst)


def test_prompts_that_fit_a_burst_together_burst_in_shared_calls():
    """Three agents' rests after the first of four decodes (3 / 197 / 1,694 tokens; on an H100 they ran as three
    bursts, one prompt per call, 0.9 s): together they fit 400 ms in shared calls by the H100's warm-up times (256 x 2
    for the two short ones, then two 1,024 x 1), so they burst together; a fourth whose joining would take the burst
    past the limit waits, as does a long first turn; the burst goes on with the prompts of it still prefilling."""
    from strata_jax.engine.job import Job
    from strata_jax.engine.prefill_policy import PrefillPolicy
    from strata_jax.engine.protocol import GenerationRequest, SamplingParams

    def job(remaining, pos=16000):
        return Job(GenerationRequest(tuple(range(pos + remaining)), SamplingParams()), stream=None, seed=0,
                   submitted=0.0, pos=pos)

    config = EngineConfig(slots=8, prefill_chunks=(256, 1024, 4096), prefill_batch=4, decode_share=0.7,
                          prefill_burst_ms=400)
    policy = PrefillPolicy(config)
    rests = [job(3), job(197), job(1694)]
    longer, first_turn = job(3000), job(20000, pos=0)
    assert policy.burst(rests + [longer], decoding=True, now=1.0) == []  # before warm-up's timings: no burst
    policy.warmed_up(H100_SECONDS)
    assert policy.estimate_together(rests) == pytest.approx(0.069 + 0.083 + 0.083)
    assert policy.estimate(longer) == pytest.approx(0.258)  # alone it fits (one 4,096 x 1 call) ...
    # ... with the three: 1,024 x 4, then 1,024 x 2 for 670 + 1,976, then 1,024 x 1 for 952: 0.488 s
    assert policy.estimate_together(rests + [longer]) == pytest.approx(0.261 + 0.144 + 0.083)
    assert policy.burst(rests + [longer, first_turn], decoding=True, now=1.0) == rests and policy.bursts == 1
    rests[0].pos = rests[1].pos = 16200  # the two short ones ended in the burst's first call
    assert policy.burst(rests[2:] + [longer, first_turn], decoding=True, now=1.0) == rests[2:]
    assert policy.bursts == 1
    rests[2].pos = len(rests[2].fill)  # the burst ended; the next one may take the 3,000-token rest
    assert policy.burst([longer, first_turn], decoding=True, now=1.0) == [longer] and policy.bursts == 2
