"""Experts streamed from pinned host memory inside the step (`host_path="stream"`, strata_jax/model/expert_stream.py):
any split of the experts between the device pool and host memory computes what all-resident experts compute (the
pure-jnp float32 reference of the packed format), through the decode path (pool + staging rounds, overflow
included) and the prompt-chunk path (pool and staging in one kernel call); placement promotes streamed experts;
copies that cannot happen fail loudly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx

import strata_jax
from pallas_kernels import PackedExperts
from pallas_kernels.onebit_reference import moe_experts_1bit_reference
from strata_jax.engine.placement import ExpertPlacement, PlacementConfig, _write_pool_streamed
from strata_jax.model import expert_stream
from strata_jax.model.config import ExpertQuantization, load_config
from strata_jax.model.expert_stream import RowLayout, stream_copy_slots
from strata_jax.model.moe import QuantizedExperts, RoutingCounts
from strata_jax.weights.onebit import quantize_experts

CKPT = FIXTURES / "ckpt" / "qwen4_exp_causal"  # 8 experts per layer, top-4
PROMPT = [5, 17, 300, 42, 9, 77, 123, 8, 250, 31]
E, K = 32, 4  # the module tests: 32 experts of the fixture's shapes, top-4


@pytest.fixture(scope="module")
def experts():
    """All E experts packed, as the loader hands them over: {kind: (bits, scales)}."""
    cfg = load_config(CKPT)
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    rng = np.random.default_rng(0)
    out = {}
    for kind, shape in (("gate_up", (E, 2 * i, h)), ("down", (E, h, i))):
        pk = quantize_experts(rng.normal(size=shape).astype(np.float32), group=64, planes=1)
        out[kind] = (pk.bits, pk.scales)
    return out


def _module(experts, pool: int, **quant):
    cfg = dataclasses.replace(load_config(CKPT), num_experts=E, num_experts_per_tok=K)
    q = ExpertQuantization(group=64, impl="xla", gpu_experts=pool, host_path="stream", **quant)
    module = nnx.eval_shape(lambda: QuantizedExperts(cfg, q))
    for kind, (bits, scales) in experts.items():
        module.load(kind, bits, scales)
    graphdef, state = nnx.split(module)

    @jax.jit
    def run(state, x, ids, weights, valid):
        m = nnx.merge(graphdef, state)
        return m(x, ids, weights, valid), nnx.state(m, RoutingCounts)

    return module, graphdef, state, run


def _reference(experts, x, ids, weights, valid):
    gu, dn = (PackedExperts(jnp.asarray(b), jnp.asarray(s), 64) for b, s in experts.values())
    out = np.asarray(moe_experts_1bit_reference(x, ids, weights, gu, dn))
    return np.where(np.asarray(valid)[:, None], out, 0.0)


def _inputs(n: int, seed: int, valid=None):
    rng = np.random.default_rng(seed)
    h = load_config(CKPT).hidden_size
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(n)]), jnp.int32)
    w = jnp.asarray(rng.dirichlet(np.ones(K), size=n), jnp.float32)
    return x, ids, w, jnp.ones((n,), bool) if valid is None else jnp.asarray(valid)


def _check(out, ref, valid):
    out = np.where(np.asarray(valid)[:, None], np.asarray(out), 0.0)
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(out - ref).max()


@pytest.mark.parametrize("pool", [16, 8, 12])  # half, a quarter, 12 experts per layer in the device pool
@pytest.mark.parametrize("tokens", [1, 5, 12])  # decode (all pairs staged; rounds) ... a chunk (one merged call)
def test_any_split_matches_the_reference(experts, pool, tokens):
    _, _, state, run = _module(experts, pool)
    x, ids, w, valid = _inputs(tokens, seed=pool * 100 + tokens)
    out, counts = run(state, x, ids, w, valid)
    _check(out, _reference(experts, x, ids, w, valid), valid)
    streamed = [v.get_value() for p, v in nnx.to_flat_state(counts) if p[-1] == "streamed"][0]
    missing = len({int(e) for e in np.asarray(ids).ravel() if e >= pool})  # initial pool: experts 0..pool-1
    assert int(streamed[0]) == missing  # every missing expert of the call was staged, none twice


@pytest.mark.parametrize("tokens,quant,per_round", [(3, dict(copy_slots=1), 1),  # decode: 1 row per round
                                                     (12, dict(prefill_copy_slots=5), 5)])  # a chunk in rounds of 5
def test_overflow_rounds_are_exact(experts, tokens, quant, per_round):
    """Fewer staging rows than missing experts: further rounds, each as exact as the first."""
    _, _, state, run = _module(experts, 8, **quant)
    x, ids, w, valid = _inputs(tokens, seed=7)
    out, counts = run(state, x, ids, w, valid)
    _check(out, _reference(experts, x, ids, w, valid), valid)
    staged, rows, rounds = [v.get_value() for p, v in nnx.to_flat_state(counts) if p[-1] == "streamed"][0]
    missing = len({int(e) for e in np.asarray(ids).ravel() if e >= 8})
    assert missing > 2 * per_round and int(staged) == missing
    assert int(rounds) == -(-missing // per_round) and int(rows) == int(rounds) * per_round


@pytest.mark.parametrize("tokens,quant", [(1, {}), (3, dict(copy_slots=1)), (12, {})])
def test_the_pallas_copy_is_exact_and_moves_live_rows_only(experts, tokens, quant):
    """`stream_copy="pallas"` (one kernel reading the host rows; interpret mode here): the same outputs as the
    reference for decode, overflow rounds and a merged chunk, and the rows it counts as copied are the staged
    experts alone (dead staging rows cost no bytes), where the "slices" copy counts every staging row."""
    for copy in ("pallas", "slices"):
        _, _, state, run = _module(experts, 8, stream_copy=copy, **quant)
        x, ids, w, valid = _inputs(tokens, seed=21 + tokens)
        out, counts = run(state, x, ids, w, valid)
        _check(out, _reference(experts, x, ids, w, valid), valid)
        staged, rows, rounds = [v.get_value() for p, v in nnx.to_flat_state(counts) if p[-1] == "streamed"][0]
        slots = stream_copy_slots(tokens, K, E, 8, quant.get("copy_slots"))
        assert int(rows) == (int(staged) if copy == "pallas" else int(rounds) * slots)
        assert int(staged) == len({int(e) for e in np.asarray(ids).ravel() if e >= 8})
    with pytest.raises(ValueError, match="stream_copy"):
        ExpertQuantization(stream_copy="dma")


@pytest.mark.parametrize("copy", ["pallas", "slices"])
def test_pairs_sharing_a_missing_expert_stage_it_once(experts, copy):
    """A call of <= SMALL_CALL_PAIRS pairs gives each pair a staging row; tokens that share a missing expert read
    the row of its first pair, and only that row is copied (counted once; the "pallas" copy moves it alone)."""
    _, _, state, run = _module(experts, 8, stream_copy=copy)
    x, _, w, valid = _inputs(3, seed=5)
    ids = jnp.asarray([[9, 1, 12, 10], [12, 9, 2, 3], [4, 12, 13, 0]], jnp.int32)  # 9 twice, 12 three times
    assert stream_copy_slots(3, K, E, 8) == 3 * K  # the per-pair form
    out, counts = run(state, x, ids, w, valid)
    _check(out, _reference(experts, x, ids, w, valid), valid)
    staged, rows, rounds = [v.get_value() for p, v in nnx.to_flat_state(counts) if p[-1] == "streamed"][0]
    assert int(staged) == 4 and int(rounds) == 1  # experts 9, 10, 12, 13
    assert int(rows) == (4 if copy == "pallas" else 3 * K)


def test_padding_rows_stage_nothing(experts):
    _, _, state, run = _module(experts, 8)
    x, ids, w, _ = _inputs(2, seed=3)
    ids = ids.at[1].set(jnp.asarray([20, 21, 22, 23], jnp.int32)).at[0].set(jnp.asarray([0, 1, 2, 3], jnp.int32))
    valid = jnp.asarray([True, False])
    out, counts = run(state, x, ids, w, valid)
    _check(out, _reference(experts, x, ids, w, valid), valid)
    streamed = [v.get_value() for p, v in nnx.to_flat_state(counts) if p[-1] == "streamed"][0]
    assert int(streamed[0]) == 0  # the padding row's experts were not copied


def test_placement_promotes_streamed_experts(experts):
    """Counts from streamed calls move the hot experts into the pool by a copy from host memory; outputs stay, and
    the pool update warm-up compiled serves the round (a compile there stalled every slot: 0.33 s on the CPU)."""
    module, graphdef, state, run = _module(experts, 8)
    placement = ExpertPlacement(state, graphdef, PlacementConfig(every=0, max_swaps=4))
    placement.warm_up()
    pool_updates = _write_pool_streamed._cache_size()
    x, ids, w, valid = _inputs(4, seed=11)
    ids = jnp.asarray([[20, 21, 22, 0]] * 4, jnp.int32)  # 20-22 are hot, outside the initial pool
    for _ in range(3):
        _, counts = run(state, x, ids, w, valid)
        placement.store_counts(counts)
    compiled = run._cache_size()
    assert placement.round() == 3
    assert _write_pool_streamed._cache_size() == pool_updates
    layer = placement.layers[0]
    assert all(layer.slot_of[e] >= 0 for e in (20, 21, 22))
    for name, (kind, part) in zip(expert_stream.PARTS, [(k, j) for k in experts for j in range(2)]):
        pool = np.asarray(layer.leaves[name].get_value())
        for e in (20, 21, 22):  # the pool slot holds exactly the expert's packed arrays
            np.testing.assert_array_equal(pool[layer.slot_of[e]], np.asarray(experts[kind][part])[e])
    out, counts = run(state, x, ids, w, valid)
    _check(out, _reference(experts, x, ids, w, valid), valid)
    assert run._cache_size() == compiled  # promotion changed values, not shapes: nothing recompiled
    placement.store_counts(counts)
    placement.round(place=False)
    stats = placement.stats()
    assert stats["expert_streaming"] == 1 and stats["expert_gpu_pairs_total"] > 0
    assert stats["expert_streamed_experts_total"] == 9  # three calls of 3 missing experts before the promotion
    assert stats["expert_streamed_bytes_total"] == stats["expert_streamed_rows_total"] * module.layout.row_bytes > 0


def test_row_layout_round_trips_every_part():
    layout = RowLayout.of(hidden=96, inter=32, planes=2, group=64)  # odd bf16 count in a row: padded
    rng = np.random.default_rng(1)
    arrays = {}
    for name, shape in zip(expert_stream.PARTS, layout.shapes):
        if name.endswith("_bits"):
            arrays[name] = rng.integers(0, 2**32, size=(5, *shape), dtype=np.uint32)
        else:
            arrays[name] = rng.normal(size=(5, *shape)).astype(ml_dtypes.bfloat16)
    rows = np.zeros((5, layout.words), np.uint32)
    for name, a in arrays.items():
        layout.pack_part(rows, name, a)
    for name, got in zip(expert_stream.PARTS, layout.unpack(jnp.asarray(rows))):
        np.testing.assert_array_equal(np.asarray(got), arrays[name])
    with pytest.raises(ValueError, match="expected"):
        layout.pack_part(rows, "down_bits", arrays["gate_up_bits"])


def test_copy_slots_sizing():
    assert stream_copy_slots(1, 10, 512, 512) == 0  # nothing outside the pool
    assert stream_copy_slots(1, 10, 512, 358) == 10  # few pairs: all staged, no overflow rounds
    assert stream_copy_slots(8, 10, 512, 358) == 12  # 8 slots at 24 GiB: ~11.6 distinct experts expected to miss
    assert stream_copy_slots(1, 10, 512, 358, copy_slots=5) == 5
    assert stream_copy_slots(1, 10, 512, 500, copy_slots=50) == 10  # never more than the call's pairs
    assert stream_copy_slots(4096, 10, 512, 358) == 154  # a prompt chunk stages everything outside the pool
    assert stream_copy_slots(4096, 10, 512, 358, prefill_copy_slots=64) == 64


def test_no_pinned_host_memory_is_a_clear_error():
    class Memory:
        kind = "device"

    class Device:
        device_kind = "Accelerator without host memory kinds"

        def addressable_memories(self):
            return [Memory()]

    assert expert_stream.host_memory_kind(Device()) is None
    with pytest.raises(RuntimeError, match="host_path='stream' needs pinned host memory"):
        expert_stream.to_host_memory(np.zeros((2, 4), np.uint32), Device())


def test_failing_copy_raises_and_returns_nothing(experts, monkeypatch):
    """A copy that fails inside the step fails the call (no output to mistake for tokens)."""
    def broken(host_rows, chosen, impl):
        def fail(_):
            raise OSError("DMA from pinned host memory failed")
        return jax.pure_callback(fail, jax.ShapeDtypeStruct((chosen.shape[0], host_rows.shape[1]), jnp.uint32),
                                 chosen)

    monkeypatch.setattr(expert_stream, "gather_rows", broken)
    _, _, state, run = _module(experts, 8)
    x, ids, w, valid = _inputs(1, seed=5)
    with pytest.raises(Exception, match="DMA from pinned host memory failed"):
        jax.block_until_ready(run(state, x, ids, w, valid))


@pytest.fixture(scope="module")
def resident():
    return strata_jax.load_model(CKPT, quantize="1bit", group=64)


@pytest.mark.parametrize("gpu_experts,copy_slots,copy,memory", [(4, None, "auto", "auto"), (2, None, "auto", "auto"),
                                                                 (2, 1, "auto", "auto"), (2, None, "pallas", "auto"),
                                                                 (2, None, "auto", "mapped")])
def test_model_split_matches_all_resident(resident, gpu_experts, copy_slots, copy, memory):
    """The fixture model: greedy tokens and logits as all resident, for half and a quarter of the experts streamed
    (and with one staging row, every step overflowing into extra rounds; copied by the Pallas kernel; and from rows
    imported as a device array, `host_memory="mapped"`)."""
    split = strata_jax.load_model(CKPT, quantize="1bit", group=64, gpu_experts=gpu_experts, host_path="stream",
                                  copy_slots=copy_slots, stream_copy=copy, host_memory=memory)
    if memory == "mapped":
        rows = [v.get_value() for p, v in nnx.to_flat_state(split.state) if p[-1] == "host_rows"]
        assert rows and all(r.sharding.memory_kind == "device" for r in rows)
    ids = np.asarray([PROMPT + PROMPT[:6], PROMPT[::-1] + PROMPT[:6]], np.int32)
    a, b = resident.logits(ids), split.logits(ids)
    tol = 1e-4 if jax.default_backend() == "cpu" else 1e-2  # the GPU kernel rounds partial sums to bf16
    assert np.abs(a - b).max() <= tol * np.abs(a).max()
    assert split.generate(PROMPT, 12, stop_at_eos=False) == resident.generate(PROMPT, 12, stop_at_eos=False)
