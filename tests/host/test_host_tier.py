"""Experts split between the device pool and the host: same logits and greedy tokens as all resident, for any
split; hot-expert placement raises the pool's hit rate under skewed traffic without changing outputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import FIXTURES

import strata_jax
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine.placement import PlacementConfig

CKPT = FIXTURES / "ckpt" / "qwen4_exp_causal"  # 8 experts per layer, top-4
PROMPT = [5, 17, 300, 42, 9, 77, 123, 8, 250, 31]


@pytest.fixture(scope="module")
def resident():
    return strata_jax.load_model(CKPT, quantize="1bit", group=64)


@pytest.mark.parametrize("gpu_experts", [4, 2])  # half and a quarter of the experts on the host... and device
def test_split_matches_all_resident(resident, gpu_experts):
    split = strata_jax.load_model(CKPT, quantize="1bit", group=64, gpu_experts=gpu_experts)
    ids = np.asarray([PROMPT + PROMPT[:6], PROMPT[::-1] + PROMPT[:6]], np.int32)
    a, b = resident.logits(ids), split.logits(ids)
    # On a GPU the pool's experts go through the Pallas kernel (bf16 activations, ~2e-3 relative: bench_kernels'
    # checks) and the host's in float32, so the two runs differ by the kernel's rounding; on CPU both are float32.
    tol = 1e-4 if jax.default_backend() == "cpu" else 1e-2
    assert np.abs(a - b).max() <= tol * np.abs(a).max()
    assert split.generate(PROMPT, 12, stop_at_eos=False) == resident.generate(PROMPT, 12, stop_at_eos=False)


def _run(engine, prompts, n):
    async def go():
        out = []
        for p in prompts:
            stream = await engine.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=n, ignore_eos=True)))
            out.append([ev.token_id async for ev in stream if ev.token_id is not None])
        return out

    return asyncio.run(go())


def test_placement_raises_hit_rate_and_keeps_outputs():
    """A quarter of the experts in the pool, initially experts 0 and 1; placement brings in the most used."""
    base = strata_jax.load_model(CKPT, quantize="1bit", group=64)
    model = strata_jax.load_model(CKPT, quantize="1bit", group=64, gpu_experts=2)
    prompts = [[7] * 12, [7] * 9 + [300]]  # repeated tokens: routing concentrates on a few experts
    expected = [base.generate(p, 24, stop_at_eos=False) for p in prompts]
    config = EngineConfig(slots=2, max_context=64, prefill_chunks=(16,), prefix_cache_mib=0)
    engine = Engine(model, config, placement=PlacementConfig(every=0))
    engine.start()
    try:
        placement = engine.placement
        assert _run(engine, prompts, 24) == expected
        placement.round(place=False)
        before = placement.stats()["expert_gpu_hit_rate"]
        assert placement.round() > 0  # the hot host experts come in (scores remember the first run)
        hits0, pairs0 = placement.stats()["expert_gpu_pairs_total"], placement.stats()["expert_pairs_total"]
        assert _run(engine, prompts, 24) == expected
        placement.round(place=False)
        stats = placement.stats()
        after = (stats["expert_gpu_pairs_total"] - hits0) / (stats["expert_pairs_total"] - pairs0)
        # The same traffic again routes the same way: the hit rate becomes the hottest experts' share (measured
        # 0.25 -> 0.33 with 2 of 8 experts in the pool).
        assert after > before + 0.05, (before, after)
        for layer in placement.layers:  # the pool holds each layer's hottest experts
            resident = layer.slot_of >= 0
            assert layer.score[resident].min() >= layer.score[~resident].max() / placement.config.margin
        assert engine.stats()["expert_gpu_hit_rate"] == stats["expert_gpu_hit_rate"]
        # The host's share is exported too: host callbacks ran, and took time.
        assert stats["host_expert_calls_total"] > 0 and stats["host_expert_seconds_total"] > 0
    finally:
        engine.shutdown()


def test_host_round_trip_only_when_a_host_expert_is_routed():
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.host.pool import HostPool
    from strata_jax.host.tier import HostTier
    from strata_jax.model.config import ExpertQuantization, load_config
    from strata_jax.model.moe import QuantizedExperts
    from strata_jax.weights.onebit import quantize_experts

    cfg = load_config(CKPT)
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    quant = ExpertQuantization(group=64, impl="xla", gpu_experts=4)
    pool = HostPool()
    module = nnx.eval_shape(lambda: QuantizedExperts(cfg, quant, lambda group: HostTier(group, pool)))
    rng = np.random.default_rng(0)
    for kind, shape in (("gate_up", (e, 2 * i, h)), ("down", (e, h, i))):
        pk = quantize_experts(rng.normal(size=shape).astype(np.float32), group=64, planes=1)
        module.load(kind, pk.bits, pk.scales)
    calls = []
    compute = module.host.compute
    module.host.compute = lambda *a: calls.append(1) or compute(*a)
    graphdef, state = nnx.split(module)
    run = jax.jit(lambda st, x, ids, w: nnx.merge(graphdef, st)(x, ids, w))
    x = jnp.asarray(rng.normal(size=(3, h)), jnp.float32)
    w = jnp.full((3, 2), 0.5, jnp.float32)
    device_only = run(state, x, jnp.asarray([[0, 1], [2, 3], [1, 2]], jnp.int32), w)
    assert not calls and np.isfinite(np.asarray(device_only)).all()
    run(state, x, jnp.asarray([[0, 5], [2, 3], [1, 2]], jnp.int32), w)
    assert len(calls) == 1


def test_worker_pool_limits_blas_to_one_thread():
    """The pool parallelises over experts; BLAS threads on top would oversubscribe the cores."""
    import threadpoolctl

    from strata_jax.host.pool import HostPool

    HostPool().executor
    # numpy's own BLAS, the one the host path calls (scipy, loaded later by other code, brings its own copy).
    numpy_dir = Path(np.__file__).parent.parent
    blas = [i for i in threadpoolctl.threadpool_info()
            if i["user_api"] == "blas" and Path(i["filepath"]).is_relative_to(numpy_dir)
            and "numpy" in Path(i["filepath"]).relative_to(numpy_dir).parts[0]]
    assert blas and all(i["num_threads"] == 1 for i in blas), blas
