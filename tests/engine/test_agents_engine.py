"""Agents on the engine (fixture model): prefill pieces that run beside decoding slots, prompts that wait for
another's snapshot of their common prefix, and snapshots copied to the host in flight all give every request
exactly the greedy tokens it gets alone; cancelling a request mid-prefill frees its slot and the device memory of
its snapshots in flight."""

from __future__ import annotations

import asyncio
import time

import jax
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine import engine as engine_module
from strata_jax.engine.planner import SNAPSHOT_POOL_MARGIN, DeviceMemory


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")


@pytest.fixture(scope="module")
def engine(model):
    # Narrow pieces beside decoders (8 tokens, one prompt) and pacing that makes decoders step alone at times (no
    # bursts: these prompts are short enough to prefill at once, tests/engine/test_engine_overlap.py).
    eng = Engine(model, EngineConfig(slots=3, max_context=160, prefill_chunks=(8, 32), prefill_batch=2,
                                     snapshot_every=32, share_min_tokens=16, mixed_prefill=(8, 1), decode_share=0.5,
                                     prefill_burst_ms=0))
    eng.start()
    yield eng
    eng.shutdown()


def _spy_prefill(engine, monkeypatch) -> list[tuple[int | None, bool]]:
    """Records each prefill call's piece limit and whether a slot was decoding beside it."""
    scheduler = engine._scheduler
    real = scheduler.executor.prefill
    calls = []

    def prefill(jobs, limit=None):
        calls.append((limit, any(j is not None and not j.prefilling for j in scheduler._slots)))
        return real(jobs, limit)

    monkeypatch.setattr(scheduler.executor, "prefill", prefill)
    return calls


async def _together(engine, prompts, max_tokens: int) -> list[list]:
    """Submits `prompts` so that the engine admits them in one iteration (it waits for the scheduler's lock), and
    returns each one's events."""

    async def drain(stream):
        return [ev async for ev in stream]

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with engine._scheduler._cond:
        streams = [await engine.submit(GenerationRequest(p, params)) for p in prompts]
    return list(await asyncio.gather(*[drain(s) for s in streams]))


def test_mixed_steps_and_shared_prefixes_equal_each_alone(engine, model, monkeypatch):
    calls = _spy_prefill(engine, monkeypatch)
    system = random_prompt(300, 40)  # three sessions' common system prompt, prefilled once
    sessions = [system + random_prompt(301 + i, n) for i, n in enumerate((6, 30, 45))]
    late = random_prompt(310, 90)  # arrives while the sessions decode: its pieces run beside them
    before = engine.stats()

    async def run():
        return await asyncio.gather(_together(engine, sessions, 24), collect(engine, late, delay=0.3, max_tokens=6))

    together, late_events = asyncio.run(run())
    results = together + [late_events]
    for p, events, n in zip(sessions + [late], results, (24, 24, 24, 6)):
        assert tokens(events) == greedy(model, p, n)
        assert events[-1].finish_reason == "length"
    # The first session prefilled the common 40 tokens; the other two waited for its snapshot there.
    assert sorted(ev[0].cached_tokens for ev in results[:3]) == [0, 40, 40]
    after = engine.stats()
    assert after["shared_prefix_waits_total"] - before["shared_prefix_waits_total"] == 2
    assert any(decoding for _, decoding in calls), "no prefill ran beside a decoding slot"
    assert all(limit == 8 for limit, decoding in calls if decoding)
    assert any(limit == 32 for limit, decoding in calls if not decoding)


def test_a_snapshot_in_flight_never_changes_another_slots_output(engine, model, monkeypatch):
    cache = engine._scheduler.prefix_cache
    monkeypatch.setattr(cache, "poll", lambda: 0)  # nothing lands between steps: copies stay in flight
    in_flight = []
    real = cache.insert_async

    def insert_async(tokens_, state, owner=None):
        seconds = real(tokens_, state, owner)
        in_flight.append(cache.stats()["prefix_cache_pending_snapshots"])
        return seconds

    monkeypatch.setattr(cache, "insert_async", insert_async)
    decoder = random_prompt(320, 12)
    long_prompt = random_prompt(321, 110)  # snapshots at 32, 64 and 96 while the decoder runs

    async def run():
        return await asyncio.gather(collect(engine, decoder, max_tokens=40),
                                    collect(engine, long_prompt, delay=0.2, max_tokens=8))

    first, second = asyncio.run(run())
    assert tokens(first) == greedy(model, decoder, 40)
    assert tokens(second) == greedy(model, long_prompt, 8)
    assert max(in_flight) >= 2
    # A later turn restores the deepest of them (landed by the lookup) and is exact too.
    follow = long_prompt + tuple(tokens(second)) + random_prompt(322, 5)
    events = asyncio.run(collect(engine, follow, max_tokens=6))
    assert events[0].cached_tokens == len(long_prompt) + 8 - 1
    assert tokens(events) == greedy(model, follow, 6)


def test_a_first_token_goes_out_before_the_snapshots_of_its_prompt(engine, model, monkeypatch):
    """A snapshot costs the engine thread milliseconds (an H100: 12-17 ms at 24K tokens); the first token of the
    prompt it snapshots is handed out before it is taken, and the snapshot still holds the prompt's state: a later
    turn restores it exactly, also after an answer of one token (its job ended before the snapshot)."""
    scheduler = engine._scheduler
    seen = []  # (tokens snapshotted, prompt length, tokens handed out by then) per snapshot of a prompt end
    real_snapshot, real_put = scheduler._snapshot, scheduler.output.put
    handed = {}

    def put(out):
        handed[out.stream] = handed.get(out.stream, 0) + len(out.token_ids)
        return real_put(out)

    def snapshot(job, tokens_):
        if len(tokens_) == len(job.prompt):
            seen.append((len(tokens_), handed.get(job.stream, 0)))
        return real_snapshot(job, tokens_)

    monkeypatch.setattr(scheduler, "_snapshot", snapshot)
    monkeypatch.setattr(scheduler.output, "put", put)
    for seed, n, answer in ((340, 45, 5), (341, 50, 1)):
        prompt = random_prompt(seed, n)
        events = asyncio.run(collect(engine, prompt, max_tokens=answer))
        assert tokens(events) == greedy(model, prompt, answer)
        follow = prompt + tuple(tokens(events)) + random_prompt(seed + 10, 4)
        again = asyncio.run(collect(engine, follow, max_tokens=4))
        assert again[0].cached_tokens >= n and tokens(again) == greedy(model, follow, 4)
    assert seen and all(out >= 1 for _, out in seen), seen


def test_cancelling_mid_prefill_frees_the_slot_and_its_snapshot_memory(engine, model, monkeypatch):
    scheduler = engine._scheduler
    cache = scheduler.prefix_cache
    cache.poll()  # the engine is idle: land what earlier requests left in flight
    assert cache.pending_bytes == 0
    monkeypatch.setattr(cache, "poll", lambda: 0)
    taken = []
    real_insert = cache.insert_async
    monkeypatch.setattr(cache, "insert_async", lambda t, state, owner=None: taken.append(state)
                        or real_insert(t, state, owner))
    real_prefill = scheduler.executor.prefill

    def slow_prefill(jobs, limit=None):
        time.sleep(0.3)  # long enough to cancel between two pieces
        return real_prefill(jobs, limit)

    monkeypatch.setattr(scheduler.executor, "prefill", slow_prefill)
    prompt = random_prompt(330, 150)

    async def run():
        stream = await engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                                                       request_id="cancel-me"))
        while not taken:  # its first snapshot (after 32 tokens) is in flight
            await asyncio.sleep(0.01)
        engine.cancel("cancel-me")
        return [ev async for ev in stream]

    events = asyncio.run(run())
    assert events[-1].finish_reason == "cancelled" and tokens(events) == []
    deadline = time.monotonic() + 30
    while engine.stats()["slots_busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["slots_busy"] == 0 and stats["prefix_cache_pending_bytes"] == 0
    assert taken and all(leaf.is_deleted() for state in taken for leaf in jax.tree_util.tree_leaves(state))
    monkeypatch.undo()
    p = random_prompt(331, 20)  # the slot serves the next request exactly
    assert tokens(asyncio.run(collect(engine, p))) == greedy(model, p, 8)


def test_pacing_changes_on_a_running_engine(engine, model):
    """`set_prefill_pacing` takes effect without a new engine: with no decode share prefill is never deferred
    beside a decoding slot; with 95% it is; tokens stay exact either way; a share EngineConfig refuses is refused
    and changes nothing."""
    deferred = []
    try:
        for i, share in enumerate((0.0, 0.95)):
            decoder, prompt = random_prompt(330 + i, 10), random_prompt(340 + i, 100)  # nothing cached

            async def both():
                return await asyncio.gather(collect(engine, decoder, max_tokens=140),
                                            collect(engine, prompt, delay=0.05, max_tokens=4))

            engine.set_prefill_pacing(decode_share=share)
            before = engine.stats()["prefill_deferred_total"]
            first, second = asyncio.run(both())
            assert tokens(first) == greedy(model, decoder, 140) and tokens(second) == greedy(model, prompt, 4)
            deferred.append(engine.stats()["prefill_deferred_total"] - before)
        assert deferred[0] == 0 and deferred[1] > 0, deferred
        with pytest.raises(ValueError, match="decode_share"):
            engine.set_prefill_pacing(decode_share=1.0)
        assert engine.config.decode_share == 0.95
    finally:
        engine.set_prefill_pacing(decode_share=0.5)


def test_clearing_the_prefix_cache_drops_every_snapshot(engine, model):
    """After `clear_prefix_cache` a prompt that extends an earlier one is prefilled whole (no cached tokens, the
    cache empty), and its tokens stay exact; without it the same prompt resumes from a snapshot."""
    prompt = random_prompt(350, 70)  # snapshot_every 32: its prefill leaves snapshots at 32 and 64
    asyncio.run(collect(engine, prompt, max_tokens=2))
    longer = prompt + random_prompt(351, 6)
    before = engine.stats()["prefix_cache_hit_tokens_total"]
    assert tokens(asyncio.run(collect(engine, longer, max_tokens=3))) == greedy(model, longer, 3)
    assert engine.stats()["prefix_cache_hit_tokens_total"] - before >= 64
    engine.clear_prefix_cache()
    before = engine.stats()["prefix_cache_hit_tokens_total"]
    again = longer + random_prompt(352, 4)
    assert tokens(asyncio.run(collect(engine, again, max_tokens=3))) == greedy(model, again, 3)
    assert engine.stats()["prefix_cache_hit_tokens_total"] == before


def test_the_device_snapshot_pool_is_cut_to_what_fits_beside_the_largest_step(engine, monkeypatch, capsys):
    """After warm-up the engine measures its largest step's workspace (XLA's memory_analysis, reported on the CPU
    too) and cuts a device snapshot pool that the allocator's free memory cannot hold beside it: an H100 run whose
    pool grew into a 4-prompt prefill's 19.6 GB workspace failed that step for every user (docs/perf-log.md)."""
    workspace = engine._runner.largest_workspace_bytes()
    assert workspace is not None and workspace > 0
    cache = engine._scheduler.prefix_cache
    free = workspace + SNAPSHOT_POOL_MARGIN + (3 << 20)
    monkeypatch.setattr(engine_module, "device_memory", lambda: DeviceMemory(free + 100, 100, "test"))
    monkeypatch.setattr(cache, "device_budget", 64 << 20)
    engine._fit_snapshot_pool()
    assert cache.device_budget == 3 << 20
    assert "prefix cache device pool cut from 64 to 3 MiB" in capsys.readouterr().err
    monkeypatch.setattr(cache, "device_budget", 2 << 20)  # fits: left as asked
    engine._fit_snapshot_pool()
    assert cache.device_budget == 2 << 20 and "cut" not in capsys.readouterr().err
