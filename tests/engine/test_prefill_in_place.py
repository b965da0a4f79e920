"""Prefill in place (`steps.prefill_step` through `TextModel`'s `cache_rows`): the prompt rows are read and written in
the donated slot cache one layer at a time, instead of copying the slots' whole cache out and back
(`take_slots` / `put_slots`, the reference here). Same tokens, drafts and cache bytes; a workspace that does not grow
with the number of layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from strata_jax.bench.synthetic import PRESETS, preset_config, random_cache, synthetic_model
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.planner import make_plan
from strata_jax.engine.sampling import sample
from strata_jax.engine.steps import (flat_weights, greedy_sampling, jit_step, prefill_args, prefill_step, put_slots,
                                     take_slots)
from strata_jax.model.cache import init_cache
from strata_jax.model.config import ExpertQuantization, ModelConfig
from strata_jax.model.decoder import CausalLM
from strata_jax.model.moe import RoutingCounts

MTP_K = 2


def _copy_prefill(mtp_k, graphdef, state, cache, slots, tokens, n_valid, next_token, rows, temperature, top_k,
                  top_p, seed):
    """The prefill step as it was: the slots' whole cache copied out, run, and written back."""
    model = nnx.merge(graphdef, state)
    sub = take_slots(cache, slots)
    hidden, sub = model.model(tokens, sub, n_valid, rows)
    last = jnp.maximum(n_valid - 1, 0)[:, None, None]
    logits = model.logits(jnp.take_along_axis(hidden, last, axis=1))[:, 0]
    token = sample(logits, temperature, top_k, top_p, seed, sub.lengths)
    follow = jnp.where(next_token >= 0, next_token, token)
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    at_last = jnp.arange(tokens.shape[1])[None] == (n_valid - 1)[:, None]
    drafts, sub = model.mtp_drafts(hidden, jnp.where(at_last, follow[:, None], shifted), sub, n_valid, mtp_k)
    return token, drafts, put_slots(cache, slots, sub), nnx.state(model, RoutingCounts)


def _config(layers: int) -> ModelConfig:
    """The tiny preset (Flash-Next's architecture: every 4th layer attention with QSA, the others Gated DeltaNet)."""
    return ModelConfig.from_hf_dict({**PRESETS["tiny"], "num_hidden_layers": layers})


def test_prefill_in_place_equals_the_slot_copy():
    """Two prompts on slots 3 and 1 (in that order) of 4, one of them ending inside the chunk, over an int8 cache
    with MTP: the same sampled tokens and MTP drafts, the same cache up to float32 rounding (the two programs fuse
    differently: the recurrent states differ in the last bit, 3e-7), and slots 0 and 2 untouched, bit for bit."""
    cfg = _config(4)
    graphdef, state = nnx.split(synthetic_model(cfg, jnp.float32, with_mtp=True))
    cache = random_cache(cfg, 4, 256, 0, jnp.float32, kv_dtype=jnp.int8, with_mtp=True)
    cache = cache.replace(lengths=jnp.asarray([40, 90, 7, 130], jnp.int32),
                          mtp_lengths=jnp.asarray([40, 90, 7, 130], jnp.int32))
    rng = np.random.default_rng(0)
    args = prefill_args([3, 1], rng.integers(2, 1000, size=(2, 32)), [32, 19], [-1, 77], greedy_sampling(2))
    weights = flat_weights(state)
    copy = jax.jit(lambda *a: _copy_prefill(MTP_K, graphdef, state, *a))(cache, *args)
    in_place = jit_step(prefill_step, graphdef, state, MTP_K)(weights, jax.tree_util.tree_map(jnp.copy, cache), *args)
    np.testing.assert_array_equal(np.asarray(in_place[0]), np.asarray(copy[0]))
    np.testing.assert_array_equal(np.asarray(in_place[1]), np.asarray(copy[1]))
    for got, want, before in zip(*(jax.tree_util.tree_leaves(c) for c in (in_place[2], copy[2], cache))):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(got[[0, 2]], np.asarray(before)[[0, 2]])
        if got.dtype == np.int8:  # K and V: a float32 rounding apart may round to the next step, rarely
            diff = np.abs(got.astype(np.int32) - want)
            assert diff.max() <= 1 and np.mean(diff) < 1e-4
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.asarray(in_place[2].lengths).tolist() == [40, 109, 7, 162]


def _compiled_temp_bytes(cfg: ModelConfig, dtype, slots: int, ctx: int, prompts: int, chunk: int,
                         quant: ExpertQuantization | None = None) -> int:
    """XLA's temp bytes of the in-place prefill step compiled for `prompts` prompts of `chunk` tokens over `slots`
    slots of `ctx` positions (int8 KV); weights and cache abstract, nothing allocated."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, dtype, quant=quant)))
    cache = jax.eval_shape(lambda: init_cache(cfg, slots, ctx, dtype, kv_dtype=jnp.int8))
    args = prefill_args(np.arange(prompts), np.zeros((prompts, chunk)), np.full(prompts, chunk),
                        np.full(prompts, -1), greedy_sampling(prompts))
    compiled = jit_step(prefill_step, graphdef, state).lower(flat_weights(state), cache, *args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _prefill_temp_bytes(layers: int, ctx: int) -> tuple[int, int]:
    """(XLA temp bytes of the compiled in-place prefill step, one slot's bytes of one attention layer) for the tiny
    preset with `layers` layers, 2 slots of `ctx` positions, int8 KV, one prompt of 64 tokens."""
    cfg = _config(layers)
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, ctx, jnp.float32, kv_dtype=jnp.int8))
    layer = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache.layers[3].mixer)) // 2
    return _compiled_temp_bytes(cfg, jnp.float32, 2, ctx, 1, 64), layer


@pytest.mark.skipif(tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11),
                    reason="XLA:CPU of jaxlib 0.10 drops the optimization barriers before scheduling")
def test_prefill_workspace_holds_one_layers_rows():
    """Two more attention layers (4 -> 12 layers) add less than one attention layer's rows to the prefill step's
    workspace (a copy of the slot's cache grows by two: each attention layer holds 27 MiB of the slot here)."""
    small, layer = _prefill_temp_bytes(4, 65536)
    large, _ = _prefill_temp_bytes(12, 65536)
    assert layer > 20 << 20
    assert large - small < layer, (small, large, layer)


@pytest.mark.gpu
def test_planned_workspace_bounds_the_compiled_prefill_on_gpu():
    """Flash-Next at 4 slots x 262,144 int8 (the shape that now fits 32 GB): XLA's temp bytes for the prefill step
    the planner sizes (its default chunk) stay within the planner's workspace, which counts one layer's slot rows
    (340 MiB) where the copy of the slot's whole cache was 4.09 GiB."""
    cfg, quant = preset_config("flash-next-125b"), ExpertQuantization(planes=1, group=128)
    engine = EngineConfig(slots=4, max_context=262_144, cache_dtype="int8")
    plan = make_plan(cfg, quant, engine, vram_budget_mib=32768)
    assert plan.fits and plan.workspace.phase.startswith("prefill")
    temp = _compiled_temp_bytes(cfg, jnp.bfloat16, engine.slots, engine.max_context, max(engine.prefill_batches),
                                engine.chunk, quant)
    print(f"prefill temp {temp / 2**20:.0f} MiB, planned workspace {plan.workspace.bytes / 2**20:.0f} MiB")
    assert temp <= plan.workspace.bytes
