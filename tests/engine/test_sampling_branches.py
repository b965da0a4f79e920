"""`sampling.set_branch_mode("select")`: the optional work computed on both sides and selected gives exactly the
outputs of the `lax.cond` form, for every combination of slots that do and do not need it, and the traced step
then holds no conditional at all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.engine import sampling
from strata_jax.engine.sampling import apply_token_mask, sample, set_branch_mode, token_logprobs

V = 300


@pytest.fixture
def modes():
    yield
    set_branch_mode("auto")


def _run(mode: str, temperature, top_k, top_p, constrained: bool, wanted: bool):
    set_branch_mode(mode)
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(3, V)) * 3, jnp.float32)
    mask = jnp.asarray(np.random.default_rng(4).integers(-2**31, 2**31, size=(3, -(-V // 32))), jnp.int32)

    @jax.jit
    def step(logits, mask, temperature, top_k, top_p):
        masked = apply_token_mask(logits, mask, jnp.asarray(constrained))
        tokens = sample(masked, temperature, top_k, top_p, jnp.arange(3, dtype=jnp.uint32), jnp.full((3,), 7))
        return tokens, token_logprobs(logits, tokens, 4, jnp.asarray(wanted))

    args = (logits, mask, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32))
    return jax.tree_util.tree_map(np.asarray, step(*args)), step.lower(*args).as_text()


@pytest.mark.parametrize("temperature,top_k,top_p", [([0, 0, 0], [0, 0, 0], [1, 1, 1]),  # all greedy
                                                     ([0.8, 0, 1.2], [0, 0, 0], [1, 1, 1]),  # draws, no cut
                                                     ([0.8, 0, 1.2], [5, 0, 0], [1, 0.9, 0.5])])  # truncated
@pytest.mark.parametrize("constrained,wanted", [(False, False), (True, True)])
def test_select_matches_cond(modes, temperature, top_k, top_p, constrained, wanted):
    (tokens_c, lp_c), hlo_c = _run("cond", temperature, top_k, top_p, constrained, wanted)
    (tokens_s, lp_s), hlo_s = _run("select", temperature, top_k, top_p, constrained, wanted)
    np.testing.assert_array_equal(tokens_c, tokens_s)
    for a, b in zip(lp_c, lp_s):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "stablehlo.case" in hlo_c or "stablehlo.if" in hlo_c
    assert "stablehlo.case" not in hlo_s and "stablehlo.if" not in hlo_s


def test_unknown_mode_is_refused(modes):
    with pytest.raises(ValueError, match="branch mode"):
        set_branch_mode("skip")
    assert sampling._mode == "auto"
    on_gpu = jax.default_backend() == "gpu"
    assert sampling.branch_mode(1) == ("select" if on_gpu else "cond")
    assert sampling.branch_mode(8 * 9) == ("select" if on_gpu else "cond")  # 8 slots' verify windows chain
    assert sampling.branch_mode(sampling.SELECT_MAX_ROWS + 1) == "cond"  # large steps: not measured, kept as was
    set_branch_mode("select")
    assert sampling.branch_mode(1000) == "select"
