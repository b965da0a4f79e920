"""A host-tier model's routing counters in the engine: every step consumes the counters it is given
(`EngineConfig.donate_counts`) and the runner puts the returned ones back, so the tokens and the placement's
counts are those of the non-donating engine; /metrics read from another thread while slots decode never sees a
consumed counter; the runner re-reads the weights only when the placement rewrote them; a failed step that consumed
the counters leaves zeroed ones, and the next request runs."""

from __future__ import annotations

import asyncio
import logging
import threading

import jax
import numpy as np
import pytest
from conftest import FIXTURES

import strata_jax
import strata_jax.engine.steps as steps_module
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine.placement import PlacementConfig

CKPT = FIXTURES / "ckpt" / "qwen4_exp_causal"  # 8 experts per layer, top-4
PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 8], [7] * 9 + [250, 31]]
TOKENS = 20


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(CKPT, quantize="1bit", group=64, gpu_experts=3, host_path="stream")


def _engine(model, every: int = 4, **kw) -> Engine:
    """An engine whose placement runs a round (and may promote experts) every `every` decode steps."""
    config = EngineConfig(slots=2, max_context=64, prefill_chunks=(16,), prefix_cache_mib=0, **kw)
    engine = Engine(model, config, placement=PlacementConfig(every=every))
    engine.start()
    return engine


def _generate(engine, prompts) -> list[list[int]]:
    async def one(p):
        stream = await engine.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=TOKENS, ignore_eos=True)))
        return [ev.token_id async for ev in stream if ev.token_id is not None]

    async def all_at_once():
        return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(all_at_once())


def _counts(engine) -> tuple[int, int]:
    engine.placement.round(place=False)
    stats = engine.placement.stats()
    return stats["expert_pairs_total"], stats["expert_gpu_pairs_total"]


def test_donated_counters_give_the_same_tokens_and_counts(model):
    results = {}
    for donate in (False, True):
        engine = _engine(model, every=0, donate_counts=donate)  # no promotions: both runs see the same pool
        try:
            assert engine._runner.donates_counts == donate
            results[donate] = (_generate(engine, PROMPTS), _counts(engine))
            # The runner's flat weights and the model's state hold the same, live counters.
            runner = engine._runner
            for i, var in zip(runner._flat.counter_at, runner._flat.counter_vars):
                assert runner._weights()[i] is var.get_value() and not var.get_value().is_deleted()
        finally:
            engine.shutdown()
    assert results[True] == results[False]
    pairs, _ = results[True][1]
    assert pairs > 0


def test_metrics_from_another_thread_while_decoding(model):
    engine = _engine(model)
    errors, reads, done = [], [0], threading.Event()

    def scrape():
        while not done.is_set():
            try:
                engine.stats()
                reads[0] += 1
            except Exception as e:  # a consumed counter read mid-step would land here
                errors.append(e)

    reader = threading.Thread(target=scrape)
    reader.start()
    try:
        out = _generate(engine, PROMPTS)
    finally:
        done.set()
        reader.join()
        engine.shutdown()
    assert not errors, errors[:1]
    assert reads[0] > 0 and all(len(t) == TOKENS for t in out)


def test_weights_are_reread_only_after_the_placement_writes(model, monkeypatch):
    engine = _engine(model, overlap_steps=False)
    calls = []
    real = steps_module.flat_weights
    monkeypatch.setattr(steps_module, "flat_weights", lambda state: calls.append(1) or real(state))
    try:
        before = engine.stats()["expert_placement_rounds_total"]
        _generate(engine, PROMPTS[:1])
        stats = engine.stats()
        rounds, steps = stats["expert_placement_rounds_total"] - before, stats["decode_steps_total"]
    finally:
        engine.shutdown()
    assert steps >= TOKENS - 1 and rounds >= 1
    # One re-read after each round (its moves all land between the same two steps), none for the steps between.
    assert 1 <= len(calls) <= rounds + 1 < steps


def test_a_failed_step_that_consumed_the_counters_leaves_zeroed_ones(model):
    engine = _engine(model)
    runner = engine._runner
    try:
        first = _generate(engine, PROMPTS[:1])
        real = dict(runner._compiled)

        def consume_and_fail(weights, cache, *args):
            for i in runner._flat.counter_at:
                weights[i].delete()
            jax.tree_util.tree_map(lambda a: a.delete(), cache)
            raise RuntimeError("injected device failure")

        runner._compiled = {key: consume_and_fail for key in real}
        failed = _generate(engine, PROMPTS[:1])
        assert failed == [[]]  # the request failed (no tokens), the engine lives on
        for i, var in zip(runner._flat.counter_at, runner._flat.counter_vars):
            value = var.get_value()
            assert runner._weights()[i] is value and not value.is_deleted()
            assert not np.asarray(value).any()
        runner._compiled = real
        assert _generate(engine, PROMPTS[:1]) == first
    finally:
        engine.shutdown()


class _Compiles(logging.Handler):
    """Collects the names of the functions JAX compiles (from its compile log), on any thread."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split(" with ")[0][len("Compiling "):])


@pytest.mark.parametrize("host_path", ["stream", "compute"])
def test_serving_after_warm_up_compiles_nothing(host_path):
    """What a host tier runs while serving (the steps, placement rounds that promote experts, the counters'
    reads and resets) was compiled at warm-up: a compile on the engine thread stalls every slot (the first placement
    round once compiled its pool update there, ~0.4 s on the CPU, inside every measured run). The caches are cleared
    first, so that an earlier test's compiles cannot hide one."""
    jax.clear_caches()
    fresh = strata_jax.load_model(CKPT, quantize="1bit", group=64, gpu_experts=3, host_path=host_path)
    engine = _engine(fresh, every=4)
    compiles = _Compiles()
    log = logging.getLogger("jax")
    was = jax.config.jax_log_compiles
    log.addHandler(compiles)
    jax.config.update("jax_log_compiles", True)
    try:
        _generate(engine, PROMPTS)
        promoted = engine.placement.stats()["expert_promotions_total"]
    finally:
        jax.config.update("jax_log_compiles", was)
        log.removeHandler(compiles)
        engine.shutdown()
    assert promoted > 0  # rounds moved experts: the pool update ran while serving
    assert compiles.names == []
