"""The serving engine on a fixture model: batching never changes a request's output, the prefix cache is exact,
cancellation frees slots, and bad requests fail alone."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, PromptTooLong, SamplingParams

CTX = 160


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


@pytest.fixture(scope="module")
def engine(model):
    eng = Engine(model, EngineConfig(slots=3, max_context=CTX, prefill_chunks=(8, 32), snapshot_every=32))
    eng.start()
    yield eng
    eng.shutdown()


_prompt, _collect, _tokens = random_prompt, collect, tokens


def test_batched_equals_alone_together_and_staggered(engine, model):
    prompts = [_prompt(i, n) for i, n in enumerate((3, 45, 70, 9, 33))]  # 5 requests on 3 slots: some queue

    async def run():
        together = await asyncio.gather(*[_collect(engine, p) for p in prompts])
        staggered = await asyncio.gather(*[_collect(engine, p, delay=0.15 * i) for i, p in enumerate(prompts)])
        return together, staggered

    together, staggered = asyncio.run(run())
    for p, a, b in zip(prompts, together, staggered):
        alone = greedy(model, p, 8)
        assert _tokens(a) == alone
        assert _tokens(b) == alone
        assert a[-1].finish_reason == "length" and a[-1].timing is not None
        assert a[0].prompt_tokens == len(p)


def test_prefix_cache_hit_is_exact(engine, model):
    system = _prompt(100, 64)  # two whole 32-token chunks: snapshots at 32 and 64
    first = system + _prompt(101, 10)
    second = system + _prompt(102, 17)
    asyncio.run(_collect(engine, first))
    events = asyncio.run(_collect(engine, second))
    assert events[0].cached_tokens == 64
    assert _tokens(events) == greedy(model, second, 8)
    # A follow-up turn extends the whole previous exchange (prompt + answer): reuses the end-of-request snapshot.
    answer = _tokens(events)
    follow = second + tuple(answer) + _prompt(103, 5)
    events2 = asyncio.run(_collect(engine, follow))
    assert events2[0].cached_tokens == len(second) + len(answer) - 1
    assert _tokens(events2) == greedy(model, follow, 8)
    # A turn that re-sends the prompt with another answer (as a chat template re-renders it) resumes at the end of
    # the prompt, past the last 32-token boundary: the snapshot taken when its prefill ended.
    other = second + _prompt(104, 6)
    events3 = asyncio.run(_collect(engine, other))
    assert events3[0].cached_tokens == len(second)
    assert _tokens(events3) == greedy(model, other, 8)


def test_cancellation_frees_the_slot(engine, model):
    other = _prompt(7, 20)

    async def run():
        long_stream = await engine.submit(GenerationRequest(_prompt(8, 10), SamplingParams(max_tokens=100,
                                                                                           ignore_eos=True)))
        other_task = asyncio.create_task(_collect(engine, other, max_tokens=12))
        got = 0
        async for _ in long_stream:
            got += 1
            if got == 3:
                break
        await long_stream.aclose()  # the client went away
        for _ in range(100):
            if engine.stats()["slots_busy"] <= 1:
                break
            await asyncio.sleep(0.05)
        busy = engine.stats()["slots_busy"]
        return busy, await other_task

    before = engine.stats()["cancelled_total"]
    busy, other_events = asyncio.run(run())
    assert busy <= 1
    assert engine.stats()["cancelled_total"] == before + 1
    assert _tokens(other_events) == greedy(model, other, 12)


def test_prompt_longer_than_context_fails_alone(engine, model):
    ok_prompt = _prompt(9, 12)

    async def run():
        task = asyncio.create_task(_collect(engine, ok_prompt))
        with pytest.raises(PromptTooLong, match=rf"prompt is too long: {CTX + 5} tokens > {CTX - 1} maximum"):
            await engine.submit(GenerationRequest(_prompt(10, CTX + 5)))
        with pytest.raises(ValueError, match="token ids"):
            await engine.submit(GenerationRequest((1, 2, 10**6)))
        return await task

    events = asyncio.run(run())
    assert _tokens(events) == greedy(model, ok_prompt, 8)


def test_output_is_clamped_to_the_context(engine):
    events = asyncio.run(_collect(engine, _prompt(11, CTX - 3), max_tokens=50))
    assert len(_tokens(events)) == 3 and events[-1].finish_reason == "length"


def test_sampling_is_reproducible_and_independent_of_batch(engine, model):
    p = _prompt(12, 15)
    alone = asyncio.run(_collect(engine, p, temperature=1.0, seed=5, max_tokens=10))

    async def crowded():
        res = await asyncio.gather(
            _collect(engine, p, temperature=1.0, seed=5, max_tokens=10),
            _collect(engine, _prompt(13, 30), temperature=0.7, seed=1),
            _collect(engine, _prompt(14, 4)),
        )
        return res[0]

    assert _tokens(asyncio.run(crowded())) == _tokens(alone)
    want = greedy(model, p, 10)
    assert _tokens(alone) != want  # temperature 1 on a random model really samples
    top1 = asyncio.run(_collect(engine, p, temperature=1.0, top_k=1, seed=3, max_tokens=10))
    assert _tokens(top1) == want
    tiny_p = asyncio.run(_collect(engine, p, temperature=1.0, top_p=1e-6, seed=3, max_tokens=10))
    assert _tokens(tiny_p) == want


def test_stop_token_and_stop_string(engine, model):
    p = _prompt(15, 11)
    full = asyncio.run(_collect(engine, p, max_tokens=12))
    tokens = _tokens(full)
    stopped = asyncio.run(_collect(engine, p, max_tokens=12, stop_token_ids=(tokens[4],)))
    assert _tokens(stopped) == tokens[: tokens.index(tokens[4]) + 1]
    assert stopped[-1].finish_reason == "stop"
    text = "".join(ev.text for ev in full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    cut = asyncio.run(_collect(engine, p, max_tokens=12, stop_strings=(stop,)))
    assert cut[-1].finish_reason == "stop_string" and cut[-1].stop_string == stop
    assert "".join(ev.text for ev in cut) == text[: text.index(stop)]


def test_bf16_cache_on_a_float32_model(model):
    eng = Engine(model, EngineConfig(slots=2, max_context=64, prefill_chunks=(16,), cache_dtype="bfloat16"))
    assert eng._runner.cache.layers[3].mixer.k.dtype == np.dtype("bfloat16")
    assert eng._runner.cache.layers[0].mixer.state.dtype == np.float32
    eng.start()
    try:
        p = _prompt(20, 10)
        events = asyncio.run(_collect(eng, p, max_tokens=6))
        want = greedy(model, p, 6)
        assert len(_tokens(events)) == 6
        assert _tokens(events)[0] == want[0]
    finally:
        eng.shutdown()


def test_long_prompt_logs_prefill_progress_and_first_token(engine, caplog, monkeypatch):
    # Thresholds scaled down (the engine thread reads them at each chunk): a 100-token prompt is "long" and logs
    # every chunk: 32, 64, 96 on the 32-token grid, then the last 4 tokens (an 8-token chunk) give the first token.
    scheduler = engine._scheduler
    monkeypatch.setattr(scheduler, "config",
                        dataclasses.replace(scheduler.config, progress_min_tokens=64, progress_every_s=0))
    with caplog.at_level(logging.INFO, logger="strata_jax.engine"):
        asyncio.run(_collect(engine, _prompt(40, 100), max_tokens=2))
        asyncio.run(_collect(engine, _prompt(41, 20), max_tokens=2))  # short: silent
    lines = [r.getMessage() for r in caplog.records if r.name == "strata_jax.engine"]
    progress = [line for line in lines if line.startswith("prefill ")]
    assert [line.split(": ", 1)[1].split(" in ")[0] for line in progress] == [
        "32/100 prompt tokens (32%)", "64/100 prompt tokens (64%)", "96/100 prompt tokens (96%)"]
    assert all(line.endswith("prompt tok/s") for line in progress)
    first = [line for line in lines if line.startswith("first token ")]
    assert len(first) == 1 and "TTFT" in first[0] and "100 prompt tokens (0 cached)" in first[0]
    assert first[0].endswith("prompt tok/s")


def test_a_failing_step_fails_running_requests_and_the_engine_recovers(engine, model, monkeypatch):
    steps = engine._runner
    real = steps.decode
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            steps.cache = None  # as if the donated buffers were consumed by a failed call
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(steps, "decode", broken)
    events = asyncio.run(_collect(engine, _prompt(30, 9), max_tokens=6))
    assert events[-1].finish_reason == "error" and "injected" in events[-1].error
    monkeypatch.setattr(steps, "decode", real)
    p = _prompt(31, 9)
    assert _tokens(asyncio.run(_collect(engine, p))) == greedy(model, p, 8)


def test_prefix_reads_copy_only_the_filled_part(engine, monkeypatch):
    """A prefix snapshot reads the slot's KV up to a bucket past the prefix (two per octave), not the whole context
    (at 65,536 positions the whole read cost seconds per prefill chunk on the H200), and equals the full read there;
    with the prefix cache off nothing is read at all."""
    import jax

    from strata_jax.engine.runner import read_length, read_lengths
    from strata_jax.model.cache import map_kv_positions

    runner = engine._runner
    assert read_length(1, 65536) == 1024 and read_length(5000, 4096) == 4096
    assert [read_length(n, 65536) for n in (1025, 1537, 20000, 24577, 34381)] == [1536, 2048, 24576, 32768, 49152]
    assert read_lengths(4096) == [1024, 1536, 2048, 3072, 4096] and read_lengths(1000) == [1000]
    monkeypatch.setattr("strata_jax.engine.runner.READ_MIN", 16)  # buckets below this fixture's 160 positions
    full = runner.read(0)
    part = runner.read(0, 40)
    length = read_length(40, runner.cache.max_len)
    assert length == 48 < runner.cache.max_len
    cut = map_kv_positions(full, lambda x, axis: x[(slice(None),) * axis + (slice(0, length),)])
    for a, b in zip(jax.tree_util.tree_leaves(cut), jax.tree_util.tree_leaves(part)):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert runner.snapshot_bytes(runner.cache.max_len) == sum(x.nbytes for x in jax.tree_util.tree_leaves(full))
    assert runner.snapshot_bytes(0) < runner.snapshot_bytes(runner.cache.max_len)
    scheduler = engine._scheduler
    budget, scheduler.prefix_cache.budget = scheduler.prefix_cache.budget, 0
    reads = []
    real = runner.read
    try:
        runner.read = lambda *a, **kw: reads.append(a) or real(*a, **kw)
        asyncio.run(_collect(engine, _prompt(90, 70)))
        assert reads == []
    finally:
        runner.read = real
        scheduler.prefix_cache.budget = budget
