"""The Gated DeltaNet chunks' UT system applied through its inverse (batched matmuls: by default diagonal blocks
merged pairwise, `deltanet.UT_BLOCK`, or doubling) instead of XLA's triangular solve: the inverse equals
numpy's float64 one, and chunked prefill equals a float64 numpy token-by-token recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.model import deltanet
from strata_jax.model.deltanet import (
    chunk_gated_delta_rule,
    unit_lower_inverse,
    unit_lower_inverse_blocked,
)


@pytest.mark.parametrize("c", [1, 2, 5, 48, 64])
def test_inverse_matches_float64(c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.standard_normal((3, c, c)) * 0.3, -1)
    want = np.linalg.inv(np.eye(c) + a)
    np.testing.assert_allclose(np.asarray(unit_lower_inverse(jnp.asarray(a, jnp.float32))), want, atol=1e-5)


@pytest.mark.parametrize("c,block", [(64, 16), (64, 8), (32, 16), (128, 16), (16, 16), (48, 16), (64, 64)])
def test_blocked_inverse_matches_float64(c, block):
    """Blocks merged pairwise (or, where C is not block x 2^k, doubling) give numpy's inverse, batch dims kept."""
    rng = np.random.default_rng(c + block)
    a = np.tril(rng.standard_normal((2, 3, c, c)) * 0.3 / np.sqrt(c / 16), -1)
    want = np.linalg.inv(np.eye(c) + a)
    got = np.asarray(unit_lower_inverse_blocked(jnp.asarray(a, jnp.float32), block))
    assert got.shape == a.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


def _recurrence(q, k, v, g, beta):
    b, t, h, dk = k.shape
    state = np.zeros((b, h, dk, v.shape[-1]))
    out = np.zeros(v.shape)
    for i in range(t):
        state = state * np.exp(g[:, i])[..., None, None]
        delta = (v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], state)) * beta[:, i][..., None]
        state = state + np.einsum("bhk,bhv->bhkv", k[:, i], delta)
        out[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], state)
    return out, state


@pytest.mark.parametrize("ut_block", [None, 0, 8])
def test_chunked_rule_matches_the_float64_recurrence(ut_block):
    rng = np.random.default_rng(0)
    b, t, h, d = 2, 200, 4, 32  # 200: three full chunks of 64 and a padded one
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(rng.standard_normal((b, t, h, d))) * d**-0.5, unit(rng.standard_normal((b, t, h, d)))
    v = rng.standard_normal((b, t, h, d))
    g, beta = -rng.uniform(0.01, 0.5, (b, t, h)), rng.uniform(0.1, 0.99, (b, t, h))
    out, state = chunk_gated_delta_rule(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)),
                                        jnp.zeros((b, h, d, d), jnp.float32), ut_block=ut_block)
    want_out, want_state = _recurrence(q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(state), want_state, atol=2e-5)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("ut_block,blocked", [(None, True), (0, False)])
def test_the_default_inverse_is_blocked_on_every_backend(monkeypatch, backend, ut_block, blocked):
    """Blocks by default wherever it runs (measured faster on the CPU and on an H100); `ut_block=0` doubles."""
    calls = []
    real = deltanet.unit_lower_inverse_blocked
    monkeypatch.setattr(deltanet, "unit_lower_inverse_blocked", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    rng = np.random.default_rng(1)
    args = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in ((1, 64, 2, 16),) * 3]
    g, beta = jnp.full((1, 64, 2), -0.1), jnp.full((1, 64, 2), 0.5)
    chunk_gated_delta_rule(*args, g, beta, jnp.zeros((1, 2, 16, 16)), scan_impl="jnp", ut_block=ut_block)
    assert bool(calls) == blocked

