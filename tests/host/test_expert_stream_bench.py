"""Streaming experts in the planner (`stream_plan`: streaming or host compute per device, and why) and in the tier
benchmark (`--host-path stream`, end to end on tiny shapes; no timings asserted)."""

from __future__ import annotations

import json

from strata_jax.bench.main import main
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


def test_tier_mode_streams(tmp_path):
    out = tmp_path / "tier.json"
    assert main(["--mode", "tier", "--preset", "tiny", "--dtype", "float32", "--budgets", "all,quarter",
                 "--slots", "2", "--routing", "zipf", "--ctx", "64", "--fill", "8", "--steps", "2",
                 "--warm-steps", "4", "--placement-every", "2", "--host-path", "stream", "--compute-budgets",
                 "quarter", "--copy-slots", "auto,1", "--prefill-tokens", "24", "--prefill-chunk", "16",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    decode = [r for r in rows if "tok_s" in r]
    assert [(r["budget"], r["host_path"], r["copy_slots"]) for r in decode] == [
        ("all", "none", "auto"), ("quarter", "compute", "auto"), ("quarter", "stream", "auto"),
        ("quarter", "stream", 1)]
    resident, compute, *streamed = decode
    assert resident["streamed_mb"] == 0 and compute["streamed_mb"] == 0 and compute["host_pairs"] > 0
    assert all(r["streamed_mb"] > 0 and r["host_ms"] == 0 and r["staged_experts"] > 0 for r in streamed)
    prefill = [r for r in rows if "ttft_s" in r]
    assert [(r["budget"], r["host_path"]) for r in prefill] == [("all", "none"), ("quarter", "stream"),
                                                                 ("quarter", "stream")]
    assert prefill[0]["prefill_streamed_mb"] == 0 and prefill[1]["prefill_streamed_mb"] > 0
