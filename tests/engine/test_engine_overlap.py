"""Overlapped decode (`EngineConfig.overlap_steps`): step n+1 is launched on step n's tokens before the host reads
them. On a model without PLE (the qwen3_next fixture) outputs must equal the plain API's greedy tokens, stops must
land on the right token, the end-of-request snapshot must be exact, and cancelling must not disturb the others."""

from __future__ import annotations

import asyncio

import pytest

import strata_jax
from conftest import FIXTURES
from engine_helpers import collect, greedy, random_prompt, tokens
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

CTX = 128


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next")


def _engine(model, overlap: bool) -> Engine:
    eng = Engine(model, EngineConfig(slots=3, max_context=CTX, prefill_chunks=(8, 32), snapshot_every=32,
                                     overlap_steps=overlap))
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engine(model):
    eng = _engine(model, overlap=True)
    yield eng
    eng.shutdown()


_prompt, _tokens = random_prompt, tokens


async def _collect(engine, prompt, delay=0.0, **sampling):
    return await collect(engine, prompt, delay, **{"max_tokens": 10, **sampling})


def test_overlapped_decode_equals_the_plain_api(engine, model):
    prompts = [_prompt(i, n) for i, n in enumerate((3, 40, 17, 9))]  # 4 requests on 3 slots: one queues
    before = engine._scheduler.counters["overlapped_steps"]
    generated_before = engine.stats()["generated_tokens_total"]

    async def run():
        together = await asyncio.gather(*[_collect(engine, p, max_tokens=6 + 3 * i) for i, p in enumerate(prompts)])
        staggered = await asyncio.gather(*[_collect(engine, p, delay=0.1 * i) for i, p in enumerate(prompts)])
        return together, staggered

    together, staggered = asyncio.run(run())
    for i, (p, a, b) in enumerate(zip(prompts, together, staggered)):
        assert _tokens(a) == greedy(model, p, 6 + 3 * i)
        assert _tokens(b) == greedy(model, p, 10)
        assert a[-1].finish_reason == "length" and a[-1].completion_tokens == 6 + 3 * i
    assert engine._scheduler.counters["overlapped_steps"] > before  # the overlapped path really ran
    # The token an overlapped step computes after a request stopped is dropped, not counted or sent.
    delivered = sum(len(_tokens(events)) for events in together + staggered)
    assert engine.stats()["generated_tokens_total"] - generated_before == delivered


def test_stop_token_mid_stream(engine, model):
    p = _prompt(11, 12)
    want = greedy(model, p, 10)
    stop = want[4]
    events = asyncio.run(_collect(engine, p, stop_token_ids=(stop,)))
    got = _tokens(events)
    assert got == want[: want.index(stop) + 1] and events[-1].finish_reason == "stop"


def test_end_of_request_snapshot_is_exact(engine, model):
    first = _prompt(20, 40)
    answer = _tokens(asyncio.run(_collect(engine, first)))
    follow = first + tuple(answer) + _prompt(21, 6)
    events = asyncio.run(_collect(engine, follow))
    # The overlapped step fed the answer's last token too: the snapshot holds the whole exchange.
    assert events[0].cached_tokens == len(first) + len(answer)
    assert _tokens(events) == greedy(model, follow, 10)


def test_cancelling_one_request_leaves_the_others_exact(engine, model):
    keep = [_prompt(30, 25), _prompt(31, 8)]

    async def run():
        stream = await engine.submit(GenerationRequest(_prompt(32, 10), SamplingParams(max_tokens=60,
                                                                                        ignore_eos=True)))
        others = asyncio.gather(*[_collect(engine, p, max_tokens=20) for p in keep])
        async for ev in stream:
            if ev.completion_tokens >= 3:
                break
        await stream.aclose()
        return await others

    results = asyncio.run(run())
    for p, events in zip(keep, results):
        assert _tokens(events) == greedy(model, p, 20)


def test_overlap_off_takes_the_plain_path(model):
    eng = _engine(model, overlap=False)
    try:
        p = _prompt(40, 15)
        assert _tokens(asyncio.run(_collect(eng, p))) == greedy(model, p, 10)
        assert eng._scheduler.counters["overlapped_steps"] == 0
    finally:
        eng.shutdown()


def test_decode_overlaps_while_another_prompt_prefills(model):
    """A prompt prefilling in narrow pieces beside a decoding request (paced: decode steps run between its pieces)
    no longer forces every decode step to the host: the steps between pieces overlap, and both outputs equal the
    plain API's greedy tokens."""
    eng = Engine(model, EngineConfig(slots=2, max_context=CTX, prefill_chunks=(8, 32), snapshot_every=32,
                                     mixed_prefill=(8, 1), decode_share=0.5, prefill_burst_ms=0))
    eng.start()
    try:
        decoder, prompt = _prompt(60, 5), _prompt(61, 90)
        seen = []
        scheduler = eng._scheduler
        real = scheduler.executor.launch

        def launch(jobs):  # records whether a prompt was mid-prefill when a step was launched overlapped
            seen.append(any(j is not None and j.prefilling for j in scheduler._slots))
            return real(jobs)

        scheduler.executor.launch = launch

        async def both():
            return await asyncio.gather(_collect(eng, decoder, max_tokens=60),
                                        _collect(eng, prompt, delay=0.05, max_tokens=4))

        first, second = asyncio.run(both())
        assert _tokens(first) == greedy(model, decoder, 60) and _tokens(second) == greedy(model, prompt, 4)
        assert sum(seen) >= 3, seen  # ~11 pieces of 8 tokens, decode steps launched overlapped between them
    finally:
        eng.shutdown()


@pytest.mark.parametrize("burst_ms", [0.0, 60_000.0])
def test_a_short_prompt_bursts_beside_a_decoder(model, burst_ms):
    """With `prefill_burst_ms` covering its whole prefill, a prompt arriving beside a decoding request prefills at
    once in full-width pieces (32 tokens: 3 calls for 90), whatever the share says; with the burst off the same
    prompt runs paced in the mixed 8-token pieces with calls deferred. Outputs equal the plain API's either way."""
    eng = Engine(model, EngineConfig(slots=2, max_context=CTX, prefill_chunks=(8, 32), snapshot_every=32,
                                     mixed_prefill=(8, 1), decode_share=0.9, prefill_burst_ms=burst_ms))
    eng.start()
    try:
        decoder, prompt = _prompt(62, 5), _prompt(63, 90)
        scheduler = eng._scheduler
        widths, real = [], scheduler.executor.prefill

        def prefill(jobs, limit=None):  # the late prompt's calls: the width its piece took
            if any(len(j.request.prompt_ids) == 90 for j in jobs):
                widths.append(scheduler.executor.chunk_size(jobs[0], limit))
            return real(jobs, limit)

        scheduler.executor.prefill = prefill
        before = eng.stats()

        async def both():
            return await asyncio.gather(_collect(eng, decoder, max_tokens=120),
                                        _collect(eng, prompt, delay=0.1, max_tokens=4))

        first, second = asyncio.run(both())
        assert _tokens(first) == greedy(model, decoder, 120) and _tokens(second) == greedy(model, prompt, 4)
        after = eng.stats()
        if burst_ms:
            assert widths == [32, 32, 32], widths
            assert after["prefill_bursts_total"] - before["prefill_bursts_total"] == 1
        else:
            # a paced 8-token piece while the decoder runs, then calls deferred (full width once it has ended)
            assert widths[0] == 8 and after["prefill_deferred_total"] > before["prefill_deferred_total"], widths
            assert after["prefill_bursts_total"] == before["prefill_bursts_total"]
    finally:
        eng.shutdown()


def test_unchanged_step_inputs_are_not_uploaded_again(engine):
    """A decode step's active mask and sampling arrays go to the device once and are reused while their values
    stay the same (token to token); a changed value (a slot starting, another temperature) is uploaded afresh."""
    import numpy as np

    runner = engine._scheduler.executor.runner
    active = np.array([True, False, True])
    sampling = (np.array([0.0, 0.0, 0.7]), np.zeros(3, np.int32), np.ones(3), np.array([1, 2, 3]))
    first = runner._unchanged_on_device(active, sampling)
    again = runner._unchanged_on_device(active.copy(), tuple(np.array(a) for a in sampling))
    assert again[0] is first[0] and all(a is b for a, b in zip(again[1], first[1]))
    changed = runner._unchanged_on_device(active, (np.array([0.0, 0.5, 0.7]), *sampling[1:]))
    assert changed[1][0] is not first[1][0] and changed[1][1] is first[1][1]
    np.testing.assert_array_equal(np.asarray(changed[1][0]), np.float32([0.0, 0.5, 0.7]))
    assert changed[1][3].dtype == np.uint32 and np.asarray(changed[0]).tolist() == [True, False, True]
