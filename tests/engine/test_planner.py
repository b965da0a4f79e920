"""Memory planner: component sizes against hand arithmetic, the pool decision at several card sizes, refusals,
scaling with slots and context, and the allocator settings."""

import dataclasses
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from strata_jax.model.config import ExpertQuantization, load_config
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.planner import (
    GIB,
    MIB,
    DeviceMemory,
    allocator_env,
    apply_env,
    choose_context,
    default_dtype,
    device_memory,
    format_plan,
    make_plan,
    snapshot_pool_bytes,
)
from strata_jax.model.cache import cache_bytes, init_cache
from strata_jax.bench.synthetic import preset_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ckpt"
ONE_PLANE = ExpertQuantization(planes=1, group=128)
SERVE = EngineConfig(slots=4, max_context=32768)

# Flash-Next by hand (hidden 2560, expert intermediate 640, 512 experts, 48 MoE layers, group 128), 1 plane:
#   gate_up bits 2560/32 words x 1280 outputs x 4 B = 409,600; scales 2560/128 x 1280 x 2 B = 51,200
#   down    bits  640/32 words x 2560 outputs x 4 B = 204,800; scales  640/128 x 2560 x 2 B = 25,600
EXPERT_BYTES = 409_600 + 51_200 + 204_800 + 25_600  # 691,200 B
ALL_EXPERTS = EXPERT_BYTES * 512 * 48  # 16.99e9 B: docs/ARCHITECTURE.md, "~17 GB at one plane plus scales"
EXPERT_SLOT = EXPERT_BYTES * 48  # one more expert per layer, in every layer: 31.64 MiB


@pytest.fixture(scope="module")
def flash():
    return preset_config("flash-next-125b")


def plan_at(cfg, gib, engine=SERVE, quant=ONE_PLANE, **kw):
    return make_plan(cfg, quant, engine, vram_budget_mib=int(gib * 1024), **kw)


def test_expert_bytes_match_the_format(flash):
    p = plan_at(flash, 139)
    assert p.expert_bytes == EXPERT_BYTES and p.moe_layers == 48
    assert p.all_expert_bytes == ALL_EXPERTS
    assert 16.9e9 < ALL_EXPERTS < 17.1e9
    assert plan_at(flash, 139, quant=ExpertQuantization(planes=2, group=128)).expert_bytes == 2 * EXPERT_BYTES
    # Dense bf16 experts: gate_up 1280 x 2560 + down 2560 x 640, 2 bytes each.
    assert plan_at(flash, 139, quant=None).expert_bytes == 3 * 640 * 2560 * 2


def test_dense_and_cache_components_by_hand(flash):
    p = plan_at(flash, 139)
    dense = dict(p.dense)
    assert dense["embeddings"] == dense["LM head"] == 248_320 * 2560 * 2
    # One GDN layer: in_proj_qkv 2560x10240, z 2560x6144, b and a 2560x48, out 6144x2560, conv 10240x4,
    # dt_bias/A_log 48 each, norm 128; bf16, 36 layers.
    gdn = 2560 * 10240 + 2560 * 6144 + 2 * 2560 * 48 + 6144 * 2560 + 10240 * 4 + 48 + 48 + 128
    assert dense["Gated DeltaNet"] == gdn * 2 * 36
    assert 9.0 * GIB < p.dense_bytes < 9.3 * GIB
    cache = dict(p.cache)
    # K and V: 2 x 32768 positions x 2 kv heads x 256 x 2 B, 12 attention layers, 4 slots = 3 GiB.
    assert cache["KV"] == 2 * 32768 * 2 * 256 * 2 * 12 * 4 == 3 * GIB
    assert cache["QSA index keys"] == 32768 * 128 * 2 * 12 * 4
    # Recurrent state: 48 v-heads x 128 x 128 float32, 36 GDN layers, 4 slots.
    assert cache["GDN recurrent state (fp32)"] == 48 * 128 * 128 * 4 * 36 * 4
    assert cache["GDN conv state"] == (2 * 16 * 128 + 48 * 128) * 3 * 2 * 36 * 4


def test_all_experts_resident_on_a_big_card(flash):
    p = plan_at(flash, 139)
    assert p.fits and p.gpu_experts == 512 and p.host_expert_bytes == 0
    assert "all 512 experts" in p.message
    assert p.device_bytes < p.budget


def test_24_gib_partial_pool(flash):
    p = plan_at(flash, 24)
    # By hand: 24576 MiB - 1536 reserve - 9374 dense - 3992 caches - 440 workspace (a 256-token prefill chunk:
    # its attention scores one 512-key block at a time; it copies one attention layer's rows of its slot, 74 MiB)
    # = 9234 MiB for experts; / 31.64 MiB per expert slot = 291 experts per layer; the other 221 (6.8 GiB) stay on
    # the host.
    room = 24 * GIB - 1536 * MIB - p.fixed_bytes
    assert p.gpu_experts == room // EXPERT_SLOT
    assert 280 <= p.gpu_experts <= 300 and p.fits
    assert p.host_expert_bytes == (512 - p.gpu_experts) * EXPERT_SLOT
    assert p.device_bytes <= p.budget < p.device_bytes + EXPERT_SLOT
    assert f"{p.gpu_experts} of 512 experts per MoE layer" in p.message


def test_12_gib_refuses_4x32k_but_fits_a_small_shape(flash):
    refused = plan_at(flash, 12)
    # 12288 - 1536 = 10752 MiB usable, but dense alone is 9374 MiB and 4 x 32K of caches 3992 MiB.
    assert not refused.fits and refused.gpu_experts == 0
    assert "caches 3.90 GiB (4 slots x 32768 tokens)" in refused.message
    assert "Would fit: --ctx 2048 (at 4 slots)" in refused.message
    assert plan_at(flash, 12, engine=EngineConfig(slots=4, max_context=2048)).fits  # the suggestion holds
    small = EngineConfig(slots=1, max_context=4096, prefill_chunks=(32, 64))
    p = plan_at(flash, 12, engine=small)
    # By hand: 12288 - 1536 - 9374 dense - 218 caches (96 KV + 12 index + 108 state + 2 conv) - ~94 workspace
    # = ~1066 MiB -> 33 experts per layer (6%); 479 per layer on the host.
    assert p.fits and 25 <= p.gpu_experts <= 40
    assert p.gpu_experts == (12 * GIB - 1536 * MIB - p.fixed_bytes) // EXPERT_SLOT


def test_4_gib_refused_names_what_does_not_fit(flash):
    p = plan_at(flash, 4)
    assert not p.fits
    assert "dense weights 9.15 GiB" in p.message and "needs a larger card" in p.message
    assert "minimum expert pool 316.4 MiB (10 of 512 experts x 48 layers)" in p.message
    table = format_plan(p)
    assert "REFUSED: does not fit" in table and "allocator:" not in table


def test_caches_scale_linearly(flash):
    def cache(slots, ctx):
        return plan_at(flash, 139, engine=EngineConfig(slots=slots, max_context=ctx)).cache_bytes

    one, two, four = cache(1, 8192), cache(2, 8192), cache(4, 8192)
    assert two == 2 * one and four == 4 * one
    # Context: KV and index keys grow linearly, recurrent state does not.
    a, b, c = cache(2, 8192), cache(2, 16384), cache(2, 32768)
    assert c - b == 2 * (b - a) and b - a > 0
    def kv(ctx):
        return dict(plan_at(flash, 139, engine=EngineConfig(slots=2, max_context=ctx)).cache)["KV"]

    assert kv(16384) == 2 * kv(8192)


def test_mtp_counts_its_layer(flash):
    without, with_mtp = plan_at(flash, 139), plan_at(flash, 139, with_mtp=True)
    assert with_mtp.moe_layers == 49
    assert dict(with_mtp.dense)["MTP (dense part)"] > 0 and dict(with_mtp.cache)["MTP KV"] > 0
    assert with_mtp.dense_bytes > without.dense_bytes


def test_fixture_weights_and_caches_match_the_checkpoint_and_real_arrays():
    path = FIXTURES / "qwen3_next"
    cfg = load_config(path)
    engine = EngineConfig(slots=2, max_context=256)
    p = make_plan(cfg, None, engine, weights_dtype="float32", with_mtp=True, vram_budget_mib=2048)
    assert p.fits and p.gpu_experts == cfg.num_experts
    header_len = struct.unpack("<Q", (path / "model.safetensors").read_bytes()[:8])[0]
    header = json.loads((path / "model.safetensors").read_bytes()[8 : 8 + header_len])
    on_disk = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    assert p.dense_bytes + p.all_expert_bytes == on_disk  # float32 checkpoint, every tensor is a parameter
    real = init_cache(cfg, 2, 256, jnp.float32, with_mtp=True)
    assert p.cache_bytes == cache_bytes(real)


def test_tiny_fixture_partial_pool():
    cfg = load_config(FIXTURES / "qwen4_exp_causal")  # 8 experts, top-4, a PLE layer
    quant = ExpertQuantization(planes=1, group=64)
    engine = EngineConfig(slots=2, max_context=512, prefill_chunks=(32,))
    big = make_plan(cfg, quant, engine, weights_dtype="float32", vram_budget_mib=2048)
    assert big.fits and big.gpu_experts == 8 and big.moe_layers == 8
    assert dict(big.cache)["PLE conv state"] > 0 and dict(big.dense)["PLE projections"] > 0
    slot = big.expert_bytes * big.moe_layers

    def with_room_for(experts: float):
        card = DeviceMemory(limit=big.reserve + big.fixed_bytes + int(experts * slot), in_use=0, source="exact")
        return make_plan(cfg, quant, engine, weights_dtype="float32", device=card)

    assert with_room_for(5.5).gpu_experts == 5
    assert with_room_for(4).gpu_experts == 4 and with_room_for(4).fits  # top-k exactly
    assert not with_room_for(3.9).fits


def test_device_budget_and_allocator_env(flash):
    card = DeviceMemory(limit=24 * GIB, in_use=0, source="fake 24 GiB card")
    p = make_plan(flash, ONE_PLANE, SERVE, device=card)
    assert p.budget == 24 * GIB and p.device_total == 24 * GIB
    env = allocator_env(p)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    fraction = float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    assert fraction * 24 * GIB <= 24 * GIB - 1536 * MIB < (fraction + 2e-6) * 24 * GIB
    # Acting as a smaller card on a big one: the budget is the smaller, the pool fraction follows it.
    big = DeviceMemory(limit=139 * GIB, in_use=GIB, source="fake H200")
    small = make_plan(flash, ONE_PLANE, SERVE, device=big, vram_budget_mib=24 * 1024)
    assert small.budget == 24 * GIB and small.gpu_experts == p.gpu_experts
    assert float(allocator_env(small)["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(22.5 / 139, abs=1e-5)
    # A budget larger than the free memory is capped by it.
    capped = make_plan(flash, ONE_PLANE, SERVE, device=card, vram_budget_mib=200 * 1024)
    assert capped.budget == 24 * GIB and "more than that" in capped.budget_source
    # Explicit budget, card unknown: only turn preallocation off.
    assert allocator_env(plan_at(flash, 24)) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_the_snapshot_pool_fits_beside_the_largest_workspace():
    """The numbers of the H100 run that failed (docs/perf-log.md, 2026-12-06): a 59.4 GiB allocator (VMM, 75% of the
    card), 45.6 GB in use when the step failed of which 8 GiB the full pool, a 19.6 GB prefill workspace: the pool
    that fits beside it is 5,819 MiB."""
    h100 = DeviceMemory(limit=63_763_120_128, in_use=45_579_501_568 - 8 * GIB, source="H100 under the VMM allocator")
    fits, why = snapshot_pool_bytes(8 * GIB, h100, 19_597_885_440)
    assert fits == 63_763_120_128 - (45_579_501_568 - 8 * GIB) - 19_597_885_440 - GIB
    assert "cut from 8,192 to 5,819 MiB" in why
    roomy = DeviceMemory(limit=100 * GIB, in_use=40 * GIB, source="fake")
    fits, why = snapshot_pool_bytes(8 * GIB, roomy, 20 * GIB)
    assert (fits, why) == (8 * GIB, None)
    fits, why = snapshot_pool_bytes(64 * GIB, roomy, 20 * GIB, margin=GIB)
    assert fits == 39 * GIB and "20,480 MiB of workspace" in why
    assert snapshot_pool_bytes(8 * GIB, None, 20 * GIB) == (8 * GIB, None)  # CPU: no statistics
    assert snapshot_pool_bytes(8 * GIB, roomy, None) == (8 * GIB, None)
    assert snapshot_pool_bytes(0, roomy, 90 * GIB) == (0, None)


def test_cpu_requires_an_explicit_budget(flash):
    assert jax.default_backend() != "cpu" or device_memory() is None
    with pytest.raises(ValueError, match="--vram-budget-mib"):
        make_plan(flash, ONE_PLANE, SERVE)
    with pytest.raises(ValueError):
        plan_at(flash, 24, vram_reserve_mib=-1)


def test_apply_env_respects_the_new_fraction_name():
    environ = {"XLA_CLIENT_MEM_FRACTION": "0.5"}
    apply_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, environ)
    assert environ == {"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    environ = {}
    apply_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, environ)
    assert environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}


def test_format_plan_lists_every_component(flash):
    p = plan_at(flash, 24)
    table = format_plan(p)
    for name, _ in p.dense + p.cache + p.workspace.terms:
        assert name in table
    for needle in ("dense weights total", "caches total (4 slots x 32768 tokens)", "workspace total",
                   f"routed experts: {p.gpu_experts} of 512 x 48 layers", "reserve (kept free)",
                   "MiB", "GiB",
                   "allocator: XLA_PYTHON_CLIENT_PREALLOCATE=false"):
        assert needle in table, needle
    host_row = next(line for line in table.splitlines() if f"{512 - p.gpu_experts} of 512 x 48 layers" in line)
    assert host_row.split()[-3] == "host" and float(host_row.split()[-1]) == pytest.approx(6.83, abs=0.01)
    assert table.count("\n") > 25


def test_probe_parses_a_fresh_process_report(monkeypatch):
    # The real probe imports jax in a child (seconds); a stand-in child reports what memory_stats would.
    from strata_jax.engine import planner

    monkeypatch.setattr(planner, "_PROBE", "import os, json; assert 'XLA_CLIENT_MEM_FRACTION' not in os.environ; "
                        "print(json.dumps([int(1e9 * float(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])), 5, 'f']))")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.3")  # must not reach the child (jax would refuse both)
    found = planner.probe_device_memory()
    assert found is not None and found.limit == 10**9 and found.free == 10**9 - 5
    assert found.source.startswith("f memory_stats")
    monkeypatch.setattr(planner, "_PROBE", "print('[null, 0, \"cpu\"]')")
    assert planner.probe_device_memory() is None
    monkeypatch.setattr(planner, "_PROBE", "raise SystemExit(3)")
    assert planner.probe_device_memory() is None


def test_serve_context_default(flash):
    cfg = load_config(FIXTURES / "qwen4_exp_causal")  # max_position_embeddings 4096: the agent minimum wins
    four = EngineConfig(slots=4)
    cpu = choose_context(None, cfg, None, four, weights_dtype="float32")
    assert cpu.tokens >= 65_536 and cpu.source == "default"
    assert choose_context(4096, cfg, None, four, device=DeviceMemory(GIB, 0, "x")).tokens == 4096  # --ctx wins
    # A big card: the cap, every expert resident.
    roomy = choose_context(None, cfg, None, four, weights_dtype="float32", vram_budget_mib=8192)
    assert roomy.tokens == 65_536 and roomy.source == "plan" and "all 8 experts" in roomy.reason
    # A card too small for 65,536: the largest multiple of 1024 below it that fits.
    small = choose_context(None, cfg, None, four, weights_dtype="float32", vram_budget_mib=1800)

    def fits(ctx):
        return make_plan(cfg, None, EngineConfig(slots=4, max_context=ctx), weights_dtype="float32",
                         vram_budget_mib=1800).fits

    assert 1024 <= small.tokens < 65_536 and small.tokens % 1024 == 0
    assert fits(small.tokens) and not fits(small.tokens + 1024)
    # Experts partly on the host: more context than 65,536 only where it costs no expert of the device pool.
    card = DeviceMemory(limit=24 * GIB, in_use=0, source="fake 24 GiB card")
    part = choose_context(None, flash, ONE_PLANE, four, device=card)

    def pool(ctx):
        return make_plan(flash, ONE_PLANE, EngineConfig(slots=4, max_context=ctx), device=card).gpu_experts

    assert part.tokens >= 65_536 and pool(part.tokens) == pool(65_536) < 512
    big = choose_context(None, flash, ONE_PLANE, four, device=DeviceMemory(139 * GIB, GIB, "fake H200"))
    assert big.tokens == flash.max_position_embeddings == 262_144


def test_weights_dtype_default():
    assert default_dtype("gpu") == "bfloat16"
    assert default_dtype("cpu") == default_dtype(None) == "float32"


def test_prefill_shapes_follow_the_plan(flash):
    from strata_jax.engine.planner import CPU_PREFILL, GPU_PREFILL_CHOICES, choose_prefill

    at = dict(vram_budget_mib=139 * 1024)
    big = choose_prefill(None, None, flash, ONE_PLANE, SERVE, **at)
    assert (big.chunks[-1], big.batch) == GPU_PREFILL_CHOICES[0] and big.chunks[:-1] == (32, 256)
    cpu = choose_prefill(None, None, flash, ONE_PLANE, SERVE)
    assert (cpu.chunks, cpu.batch) == CPU_PREFILL
    flags = choose_prefill((64, 512), 2, flash, ONE_PLANE, SERVE, **at)
    assert (flags.chunks, flags.batch) == ((64, 512), 2)
    # On a 24 GiB card a bigger prefill workspace would push experts to the host: the choice keeps the pool.
    small = choose_prefill(None, None, flash, ONE_PLANE, SERVE, vram_budget_mib=24 * 1024)
    smallest = GPU_PREFILL_CHOICES[-1]
    base = plan_at(flash, 24, engine=dataclasses.replace(SERVE, prefill_chunks=(32, 256, smallest[0]),
                                                         prefill_batch=smallest[1]))
    largest = plan_at(flash, 24, engine=dataclasses.replace(SERVE, prefill_chunks=(32, 256, 4096), prefill_batch=4))
    assert largest.gpu_experts < base.gpu_experts  # the premise: the largest choice costs experts here
    chosen = plan_at(flash, 24, engine=dataclasses.replace(SERVE, prefill_chunks=small.chunks,
                                                           prefill_batch=small.batch))
    assert chosen.gpu_experts == base.gpu_experts and (small.chunks[-1], small.batch) != GPU_PREFILL_CHOICES[0]
