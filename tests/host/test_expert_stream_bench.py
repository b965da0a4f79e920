"""Streaming experts in the planner (`stream_plan`: streaming or host compute per device, and why); the tier
benchmark's `--host-path stream` end to end: tests/bench/test_bench_tier.py."""

from __future__ import annotations

from strata_jax.bench.synthetic import preset_config
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.planner import make_plan, stream_plan
from strata_jax.model.config import ExpertQuantization
from strata_jax.model.expert_stream import stream_copy_slots


def _plan(mib: int, slots: int = 8):
    cfg = preset_config("flash-next-125b")
    engine = EngineConfig(slots=slots, max_context=4096)
    return make_plan(cfg, ExpertQuantization(planes=1, group=128), engine, vram_budget_mib=mib,
                     vram_reserve_mib=1536, suggest=False), engine


def test_stream_plan_chooses_per_device_and_says_why():
    plan, engine = _plan(24576)
    assert 0 < plan.gpu_experts < plan.num_experts
    gpu = stream_plan(plan, engine, "gpu")
    assert gpu.host_path == "stream" and "pinned host memory" in gpu.reason
    # The staging rows' room comes out of the pool: exactly what the staging needs beyond the plan's spare room.
    spare = plan.budget - plan.device_bytes
    taken = plan.gpu_experts - gpu.gpu_experts
    layer = plan.expert_bytes * plan.moe_layers
    assert taken >= 1 and (taken - 1) * layer < gpu.staging_bytes - spare <= taken * layer
    assert gpu.prefill_copy_slots == plan.num_experts - gpu.gpu_experts  # a chunk stages all outside the pool
    # Decode stages the distinct experts its slots' pairs are expected to miss, for the pool left beside the staging.
    assert gpu.copy_slots == stream_copy_slots(engine.slots, plan.top_k, plan.num_experts, gpu.gpu_experts)
    assert gpu.pinned_host_bytes == plan.all_expert_bytes
    cpu = stream_plan(plan, engine, "cpu")
    assert cpu.host_path == "compute" and cpu.gpu_experts == plan.gpu_experts and "cpu backend" in cpu.reason
    assert stream_plan(plan, engine, "gpu", "compute").host_path == "compute"
    assert stream_plan(plan, engine, "cpu", "stream").host_path == "stream"  # asked for: honoured
    resident, engine = _plan(65536)
    assert stream_plan(resident, engine, "gpu").host_path == "none"
