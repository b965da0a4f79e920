"""`jit_step_donating_counts`: the decode step with the routing counters donated besides the cache gives the same
tokens and the same counters as the engine's `jit_step`, step after step, and really consumes the counters it is
given (their buffers are reused for the outputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.bench.synthetic import preset_config, random_cache, synthetic_model
from strata_jax.engine.steps import counter_mask, decode_step, flat_weights, jit_step, jit_step_donating_counts
from strata_jax.model.config import ExpertQuantization
from strata_jax.model.moe import RoutingCounts


def test_donated_counters_match_the_engine_step():
    cfg = preset_config("tiny")
    model = synthetic_model(cfg, jnp.float32, ExpertQuantization(group=64, gpu_experts=4, host_path="stream"))
    graphdef, state = nnx.split(model)
    mask = counter_mask(state)
    counts = nnx.to_flat_state(nnx.state(model, RoutingCounts))
    assert sum(mask) == len(list(counts)) > 0  # every layer's routing counts and stream counters, nothing else
    plain, donating = jit_step(decode_step, graphdef, state), jit_step_donating_counts(decode_step, graphdef, state)
    s = 2
    ins = (jnp.asarray([5, 9], jnp.int32), jnp.ones(s, bool), (), jnp.zeros(s), jnp.zeros(s, jnp.int32),
           jnp.ones(s), jnp.zeros(s, jnp.uint32))
    weights = flat_weights(state)
    w_plain, w_don = list(weights), [jnp.copy(a) if m else a for a, m in zip(weights, mask)]
    cache_plain = random_cache(cfg, s, 32, 8, jnp.float32)
    cache_don = jax.tree_util.tree_map(jnp.copy, cache_plain)
    for _ in range(3):
        given = [w_don[i] for i in donating.counters]
        out_p, out_d = plain(w_plain, cache_plain, *ins), donating(w_don, cache_don, *ins)
        np.testing.assert_array_equal(np.asarray(out_p[0]), np.asarray(out_d[0]))
        new_p, new_d = jax.tree_util.tree_leaves(out_p[3]), jax.tree_util.tree_leaves(out_d[3])
        for a, b in zip(new_p, new_d):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert all(g.is_deleted() for g in given)  # consumed: the outputs took their buffers
        for i, a in zip(donating.counters, new_d):
            w_don[i] = a
        for i, a in zip(donating.counters, new_p):
            w_plain[i] = a
        cache_plain, cache_don = out_p[2], out_d[2]
        ins = (out_p[0], *ins[1:])
    assert int(sum(np.asarray(a).sum() for a in new_d)) > 0
    compiled = donating.lower(w_don, cache_don, *ins).compile()
    assert "ENTRY" in compiled.as_text()
