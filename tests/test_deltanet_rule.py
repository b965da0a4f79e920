"""The gated delta rule, chunked and recurrent, against a float64 numpy recurrence, from a non-zero state."""

import jax
import numpy as np
import pytest

from strata_jax.model.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _numpy_rule(q, k, v, g, beta, state):
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[..., None, None]
        kv = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t][..., None]
        s += k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def _inputs(t, seed):
    rng = np.random.default_rng(seed)
    b, h, dk, dv = 2, 3, 8, 5
    norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = norm(rng.normal(size=(b, t, h, dk))) * dk**-0.5
    k = norm(rng.normal(size=(b, t, h, dk)))
    v = rng.normal(size=(b, t, h, dv))
    g = -rng.uniform(0.0, 0.5, size=(b, t, h))
    beta = rng.uniform(0, 1, size=(b, t, h))
    state = rng.normal(size=(b, h, dk, dv))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("t", [1, 5, 64, 150])
@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_rule_matches_numpy(rule, t):
    args = _inputs(t, seed=t)
    want_out, want_state = _numpy_rule(*args)
    out, state = jax.jit(rule)(*args)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=2e-4, atol=2e-4)


def test_chunked_continues_from_split_point():
    args = _inputs(130, seed=7)
    full_out, full_state = chunk_gated_delta_rule(*args)
    a = [x[:, :70] for x in args[:5]]
    b = [x[:, 70:] for x in args[:5]]
    out1, s1 = chunk_gated_delta_rule(*a, args[5])
    out2, s2 = chunk_gated_delta_rule(*b, s1)
    np.testing.assert_allclose(np.concatenate([out1, out2], axis=1), full_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s2, full_state, rtol=1e-4, atol=1e-4)
