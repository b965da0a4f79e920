"""One request cannot hurt another: bad sampling values are refused or made safe at submit, a failure that
belongs to one request fails it alone (the others' greedy output is unchanged, even when the failed call consumed
the shared slot cache), a stuck step trips the watchdog, and shutdown ends every stream at once."""

from __future__ import annotations

import asyncio
import threading
import time

import jax
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine.job import Job
from strata_jax.engine.protocol import EngineUnavailable

CTX = 160


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


def _engine(model, **kw) -> Engine:
    eng = Engine(model, EngineConfig(slots=3, max_context=CTX, prefill_chunks=(8, 32), snapshot_every=32, **kw))
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engine(model):
    eng = _engine(model, watchdog_s=3.0)  # the last test trips it, then shuts the engine down
    yield eng
    eng.shutdown()


async def _after_tokens(engine, prompt, n: int, max_tokens: int):
    """Starts `prompt`; returns (a task collecting all its events, once `n` tokens arrived)."""
    stream = await engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    events, got = [], asyncio.Event()

    async def drain():
        async for ev in stream:
            events.append(ev)
            if len(tokens(events)) >= n:
                got.set()
        got.set()
        return events

    task = asyncio.ensure_future(drain())
    await got.wait()
    return task


def test_sampling_values_are_checked_at_submit(engine, model):
    vocab = model.config.vocab_size
    assert SamplingParams(top_k=2**31).checked(vocab).top_k == 0  # more than the vocabulary: off
    assert SamplingParams(top_k=5).checked(vocab).top_k == 5
    for bad in ({"top_k": 2**70}, {"top_k": -1}, {"temperature": float("nan")}, {"temperature": -1.0},
                {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"top_k": 2.5}, {"stop_token_ids": (vocab,)}):
        with pytest.raises(ValueError, match=next(iter(bad)).rstrip("_ids")):
            asyncio.run(engine.submit(GenerationRequest(random_prompt(1, 5), SamplingParams(**bad))))


def test_huge_top_k_beside_a_running_stream(engine, model):
    """The fuzzing run's poison request: top_k 2^31 (past int32) next to a running greedy stream."""
    running, poison = random_prompt(40, 20), random_prompt(41, 7)

    async def run():
        task = await _after_tokens(engine, running, 2, 16)
        bad = await collect(engine, poison, max_tokens=4, top_k=2**31, temperature=0.7, seed=3)
        return await task, bad

    events, bad = asyncio.run(run())
    assert tokens(events) == greedy(model, running, 16)
    assert events[-1].finish_reason == "length"
    assert bad[-1].finish_reason == "length" and len(tokens(bad)) == 4


def test_a_request_whose_inputs_fail_fails_alone(engine, model, monkeypatch):
    running, bad_prompt = random_prompt(50, 20), random_prompt(51, 6)
    real = Job.sampling

    def sampling(job):
        if job.prompt == bad_prompt:
            raise OverflowError("injected: a value the step cannot hold")
        return real.fget(job)

    monkeypatch.setattr(Job, "sampling", property(sampling))

    async def run():
        task = await _after_tokens(engine, running, 2, 16)
        bad = await collect(engine, bad_prompt, max_tokens=4)
        return await task, bad

    events, bad = asyncio.run(run())
    assert bad[-1].finish_reason == "error" and "injected" in bad[-1].error and not bad[-1].retryable
    assert tokens(events) == greedy(model, running, 16)
    assert events[-1].finish_reason == "length"


def test_a_failed_prefill_that_consumed_the_cache_costs_the_others_nothing(engine, model, monkeypatch):
    """The failed call deletes the donated slot cache: the running requests refill their slots and go on with
    exactly the tokens they would have produced."""
    runner = engine._runner
    running = [random_prompt(60, 20), random_prompt(61, 45)]
    bad_prompt = random_prompt(62, 11)
    real = runner.prefill

    def prefill(slot, tokens_, *args, **kw):
        # Its first 8 tokens: the narrowest piece holds them whichever compiled width the call takes.
        if tuple(int(t) for t in tokens_[0, :8]) == bad_prompt[:8]:
            jax.tree_util.tree_map(lambda a: a.delete(), runner.cache)  # as a failed donated call leaves it
            raise RuntimeError("injected device failure in one request's prefill")
        return real(slot, tokens_, *args, **kw)

    monkeypatch.setattr(runner, "prefill", prefill)
    refilled = engine.stats()["refilled_slots_total"]

    async def run():
        tasks = [await _after_tokens(engine, p, 3, 20) for p in running]
        bad = await collect(engine, bad_prompt, max_tokens=4)
        return [await t for t in tasks], bad

    results, bad = asyncio.run(run())
    assert bad[-1].finish_reason == "error" and "injected" in bad[-1].error
    for p, events in zip(running, results):
        assert tokens(events) == greedy(model, p, 20)
        assert events[-1].finish_reason == "length"
    assert engine.stats()["refilled_slots_total"] == refilled + 2


def test_watchdog_then_shutdown(engine, model, monkeypatch):
    """A stuck step trips the watchdog (requests failed at once, health false, submit refused) and the engine
    recovers when the step returns; then shutdown ends a running stream at once. Last in this file: it ends the
    module's engine (compiling another is slow)."""
    eng = engine
    runner = eng._runner
    real, release = runner.decode, threading.Event()
    try:
        def stuck(*args, **kw):
            release.wait(20)  # a step that does not come back
            return real(*args, **kw)

        monkeypatch.setattr(runner, "decode", stuck)
        monkeypatch.setattr(eng._scheduler, "_can_overlap", False)
        t0 = time.monotonic()
        events = asyncio.run(collect(eng, random_prompt(70, 9), max_tokens=6))
        waited = time.monotonic() - t0
        assert events[-1].finish_reason == "error" and events[-1].retryable and "stuck" in events[-1].error
        assert waited < 8
        healthy, why = eng.health()
        assert not healthy and "stuck" in why
        assert eng.stats()["engine_healthy"] == 0 and eng.stats()["watchdog_trips_total"] == 1
        with pytest.raises(EngineUnavailable):
            asyncio.run(eng.submit(GenerationRequest(random_prompt(71, 5))))
        monkeypatch.setattr(runner, "decode", real)
        release.set()
        deadline = time.monotonic() + 10
        while not eng.health()[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.health() == (True, "")
        p = random_prompt(72, 9)
        assert tokens(asyncio.run(collect(eng, p))) == greedy(model, p, 8)

        async def shut_down_while_streaming():
            task = await _after_tokens(eng, random_prompt(80, 12), 2, CTX - 20)
            t0 = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
            events = await task
            return events, time.monotonic() - t0

        events, took = asyncio.run(shut_down_while_streaming())
        assert events[-1].finish_reason == "error" and events[-1].retryable and "shutting down" in events[-1].error
        assert took < 2.5
        assert not eng.health()[0]
        with pytest.raises(EngineUnavailable):
            asyncio.run(eng.submit(GenerationRequest(random_prompt(81, 5))))
    finally:
        release.set()
        eng.shutdown()
