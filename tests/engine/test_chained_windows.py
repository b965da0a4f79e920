"""Chained verify windows (`EngineConfig.chain_windows`): with a drafter that also guesses on the device, window n+1
is built and launched on the device from window n's outputs before the host reads window n back. On the qwen3_next
fixture (no PLE) the output must equal plain greedy decoding and the same engine with every window in step with
the host (the oracle's drafts are a hash of the position, so both see the same drafts and accept the same number);
a stop token inside a chained window must end the output there, and the end-of-turn snapshot, which the window
after it would have run past, must not be taken."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.bench.oracle import OracleDrafter
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next")


def _serve(model, cfg: EngineConfig, drafter, jobs: list[tuple[tuple[int, ...], int]], stagger: float = 0.0):
    """Each (prompt, max_tokens) of `jobs` through a fresh engine; returns (token lists, counters, engine stats)."""
    eng = Engine(model, cfg, drafter=drafter)
    eng.start()
    try:
        async def run():
            return await asyncio.gather(*[collect(eng, p, stagger * i, max_tokens=n)
                                          for i, (p, n) in enumerate(jobs)])

        results = asyncio.run(run())
        return [tokens(r) for r in results], collections.Counter(eng._scheduler.counters), eng.stats()
    finally:
        eng.shutdown()


def test_chained_windows_equal_in_step_windows_and_plain_greedy(model):
    jobs = [(random_prompt(70 + i, n), m) for i, (n, m) in enumerate(((9, 40), (23, 33), (14, 45)))]
    want = [greedy(model, p, m) for p, m in jobs]
    records = [p + tuple(w) for (p, _), w in zip(jobs, want)]
    runs = {}
    for chain in (True, False):  # 3 requests on 2 slots: the third starts while the chain runs, which lands it
        cfg = EngineConfig(slots=2, max_context=128, prefill_chunks=(32,), prefix_cache_mib=0, draft_k=4,
                           adaptive_draft=False, chain_windows=chain)
        drafter = OracleDrafter(records, 0.6, model.config.vocab_size, seed=1)
        got, counters, _ = _serve(model, cfg, drafter, jobs, stagger=0.05)
        assert got == want, f"chain_windows={chain}"
        runs[chain] = counters, drafter
    (chained, oracle), (in_step, host_oracle) = runs[True], runs[False]
    assert chained["chained_windows"] > 0 and in_step["chained_windows"] == 0
    assert chained["in_step_calls"] < in_step["in_step_calls"]  # chained windows are not run in step
    # The same drafts at the same positions, the same windows: the same drafts proposed and accepted.
    assert (chained["drafted"], chained["accepted"]) == (in_step["drafted"], in_step["accepted"])
    assert 0 < chained["accepted"] < chained["drafted"]
    assert oracle.counts == host_oracle.counts and oracle.counts["diverged"] == 0


def test_a_stop_inside_a_chained_window_ends_there_and_skips_the_snapshot(model):
    prompt = random_prompt(80, 20)
    want = greedy(model, prompt, 60)
    stop = next(t for t in want[25:] if want.index(t) >= 25)  # a token first seen well into the chain
    answer = want[: want.index(stop) + 1]
    follow = prompt + tuple(answer) + random_prompt(81, 7)
    cfg = EngineConfig(slots=2, max_context=128, prefill_chunks=(32,), draft_k=4, adaptive_draft=False,
                       snapshot_every=32)
    drafter = OracleDrafter([prompt + tuple(want), follow + tuple(greedy(model, follow, 8))], 1.0,
                            model.config.vocab_size)
    eng = Engine(model, cfg, drafter=drafter)
    eng.start()
    try:
        events = asyncio.run(collect(eng, prompt, max_tokens=60, stop_token_ids=(stop,)))
        assert tokens(events) == answer and events[-1].finish_reason == "stop"
        assert eng._scheduler.counters["chained_windows"] > 0
        # Every draft right: the window after the stop's was in flight, the slot ahead of the answer. No snapshot
        # of the whole exchange, so the next turn resumes from an earlier one and still equals plain greedy.
        again = asyncio.run(collect(eng, follow, max_tokens=8))
        assert again[0].cached_tokens < len(prompt) + len(answer)
        assert tokens(again) == greedy(model, follow, 8)
    finally:
        eng.shutdown()


def test_cancelling_a_chained_request_leaves_the_other_exact(model):
    keep = random_prompt(90, 12)
    gone = random_prompt(91, 15)
    want = greedy(model, keep, 40)
    cfg = EngineConfig(slots=2, max_context=128, prefill_chunks=(32,), prefix_cache_mib=0, draft_k=4,
                       adaptive_draft=False)
    drafter = OracleDrafter([keep + tuple(want), gone + tuple(greedy(model, gone, 60))], 0.7,
                            model.config.vocab_size)
    eng = Engine(model, cfg, drafter=drafter)
    eng.start()
    try:
        async def run():
            stream = await eng.submit(GenerationRequest(gone, SamplingParams(max_tokens=60, ignore_eos=True)))
            other = asyncio.ensure_future(collect(eng, keep, max_tokens=40))
            async for ev in stream:
                if ev.completion_tokens >= 12:
                    break
            await stream.aclose()
            return await other

        assert tokens(asyncio.run(run())) == want
        assert eng._scheduler.counters["chained_windows"] > 0 and eng.stats()["cancelled_total"] == 1
    finally:
        eng.shutdown()


def test_the_oracle_guesses_the_same_on_the_device_as_on_the_host():
    import jax

    from strata_jax.engine.drafters import DeviceDrafter, DraftRequest

    rng = np.random.default_rng(2)
    records = [tuple(int(x) for x in rng.integers(0, 300, 50)) for _ in range(2)]
    oracle = OracleDrafter(records, 0.5, vocab_size=300, seed=4)
    assert isinstance(oracle, DeviceDrafter)
    oracle.bind(3, 64)
    owners = [object(), object()]
    assert oracle.device_ready(0, owners[0], records[1][:10]) and oracle.device_ready(2, owners[1], records[0][:31])
    assert not oracle.device_ready(1, object(), (7, 7, 7))  # follows no record: drafts nothing
    lengths = np.array([10, 5, 31], np.int32)
    drafts, real = jax.jit(oracle.device_drafts, static_argnums=(3,))(oracle.device_state(), np.zeros((3, 0)),
                                                                      lengths, 6)
    host = oracle.propose({0: DraftRequest(owners[0], records[1][:10], 6),
                           2: DraftRequest(owners[1], records[0][:31], 6)})
    assert np.asarray(real).tolist() == [6, 0, 6]
    assert np.asarray(drafts)[0].tolist() == host[0] and np.asarray(drafts)[2].tolist() == host[2]
    assert host[0] != list(records[1][10:16])  # some drafts planted wrong at P = 0.5


def test_mtp_windows_chain_and_stay_exact():
    model = strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next")
    jobs = [(random_prompt(95, 11), 30), (random_prompt(96, 26), 24)]
    cfg = EngineConfig(slots=2, max_context=96, prefill_chunks=(32,), prefix_cache_mib=0, draft="mtp", draft_k=3,
                       adaptive_draft=False)
    got, counters, _ = _serve(model, cfg, None, jobs)
    assert got == [greedy(model, p, n) for p, n in jobs]
    assert counters["chained_windows"] > 0 and counters["drafted"] > 0
