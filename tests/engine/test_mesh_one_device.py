"""A mesh of one device runs the step without a mesh: the same kernels and the same tokens (issue 27: "on one GPU,
the sharded code path with a 1-device mesh costs nothing against today's step"). Before the expert exchange skipped
one-device meshes, the step carried an all-gather per MoE input and a reduce-scatter per output (no-ops that XLA kept
as ops) and the H200 measured 1.16x the plain step at 32 slots."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.bench.floors import kernel_ops
from strata_jax.bench.synthetic import preset_config, random_cache, synthetic_model
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.mesh import MeshConfig, MeshSteps
from strata_jax.engine.runner import ModelRunner, RunnerModel
from strata_jax.engine.steps import decode_args, greedy_sampling
from strata_jax.model.config import ExpertQuantization
from strata_jax.model.expert_parallel import shard_state


def test_one_device_mesh_compiles_to_the_plain_step_and_decodes_the_same():
    cfg = preset_config("tiny")
    graphdef, state = nnx.split(synthetic_model(cfg, jnp.float32, ExpertQuantization()))
    slots, results = 4, {}
    for name, mesh_config in [("none", None), ("mesh", MeshConfig(1, 1, "gather"))]:
        mesh = None if mesh_config is None else mesh_config.make()
        if mesh is not None:
            shard_state(state, mesh)
        runner = ModelRunner(RunnerModel(graphdef, state, cfg, jnp.float32, False, mesh, "gather"),
                             EngineConfig(slots=slots, max_context=64, prefill_chunks=(32,)))
        cache = random_cache(cfg, slots, 64, 24, jnp.float32)
        runner.cache = cache if mesh is None else MeshSteps(mesh, slots).place_cache(cache)
        sampling, active = greedy_sampling(slots), np.ones(slots, bool)
        tokens = jnp.asarray([3, 1, 4, 1], jnp.int32)
        args = decode_args(tokens, active, sampling, (), jnp.float32, **runner._extras((slots,), None, None))
        hlo = runner._jitted["decode"].lower(runner._weights(), runner.cache, *args).compile().as_text()
        seen = []
        for _ in range(4):
            tokens = runner.decode_on_device(tokens, active, sampling).tokens
            seen.append(np.asarray(tokens))
        results[name] = (kernel_ops(hlo), np.stack(seen))
    (plain_ops, plain_tokens), (mesh_ops, mesh_tokens) = results["none"], results["mesh"]
    assert mesh_ops == plain_ops
    assert "all-gather" not in mesh_ops and "reduce-scatter" not in mesh_ops
    np.testing.assert_array_equal(mesh_tokens, plain_tokens)
