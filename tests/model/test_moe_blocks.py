"""Routed experts on dense weights off a GPU (`moe._experts_by_blocks`, XLA:CPU's ragged_dot being a dense product
over every expert): every row through its own expert, against float64 numpy, with empty experts, experts of many
blocks and of a partial block, and through `experts_reference` (the model's call) with its routing weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.model import moe


def _numpy_expert(x, gate_up, down):
    inter = gate_up.shape[0] // 2
    gu = x @ gate_up.T
    act = gu[:, :inter] / (1 + np.exp(-gu[:, :inter])) * gu[:, inter:]
    return act @ down.T


@pytest.mark.parametrize("sizes,block", [
    ([5, 0, 17, 1, 0, 9], 4),  # empty experts, one of several blocks and a partial one
    ([0, 0, 32, 0], 8),  # one expert holds every row, whole blocks
    ([3, 3, 3], None),  # the automatic block size
])
def test_rows_go_through_their_own_expert(sizes, block):
    rng = np.random.default_rng(len(sizes))
    e, h, inter = len(sizes), 12, 6
    m = sum(sizes)
    xs = rng.normal(size=(m, h)).astype(np.float32)
    gate_up = rng.normal(size=(e, 2 * inter, h)).astype(np.float32) / 3
    down = rng.normal(size=(e, h, inter)).astype(np.float32) / 3
    got = np.asarray(jax.jit(moe._experts_by_blocks, static_argnums=4)(
        jnp.asarray(xs), jnp.asarray(sizes, jnp.int32), jnp.asarray(gate_up), jnp.asarray(down), block))
    want = np.concatenate([_numpy_expert(xs[o:o + n].astype(np.float64), gate_up[i].astype(np.float64),
                                         down[i].astype(np.float64))
                           for i, (o, n) in enumerate(zip(np.cumsum([0] + sizes[:-1]), sizes))])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_experts_reference_sums_the_weighted_experts():
    rng = np.random.default_rng(0)
    n, k, e, h, inter = 40, 3, 8, 16, 8
    x = rng.normal(size=(n, h)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    ids[:10] = [0, 1, 2]  # an expert with many rows
    w = rng.random((n, k)).astype(np.float32)
    gate_up = rng.normal(size=(e, 2 * inter, h)).astype(np.float32) / 4
    down = rng.normal(size=(e, h, inter)).astype(np.float32) / 4
    got = np.asarray(jax.jit(moe.experts_reference)(x, ids, w, gate_up, down))
    want = np.zeros((n, h))
    for i in range(n):
        for j in range(k):
            want[i] += w[i, j] * _numpy_expert(x[i:i + 1].astype(np.float64), gate_up[ids[i, j]].astype(np.float64),
                                               down[ids[i, j]].astype(np.float64))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
