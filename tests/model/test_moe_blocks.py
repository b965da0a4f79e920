"""Routed experts off a GPU in blocks of one expert (`pallas_kernels.expert_blocks`; XLA:CPU's ragged_dot is a
dense product over every expert): every row through its own expert, against float64 numpy, with empty experts,
experts of many blocks and of a partial block; through `experts_reference` (the model's call) with its routing
weights; and on packed 1-bit experts, where `moe_experts_1bit` takes this form for more pairs than experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_blocks import experts_by_blocks
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
    gate_up_j, down_j = jnp.asarray(gate_up), jnp.asarray(down)
    got = np.asarray(jax.jit(lambda x, n: experts_by_blocks(x, n, lambda i: (gate_up_j[i], down_j[i]), e, block))(
        jnp.asarray(xs), jnp.asarray(sizes, jnp.int32)))
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


@pytest.mark.parametrize("t,k,n_exp,group,planes,routing", [
    (40, 4, 16, 32, 1, "random"),  # the demo's experts and top-k at a 40-token chunk
    (33, 3, 5, 32, 2, "crowd"),  # two planes, one expert in every token: many blocks of it
    (9, 4, 12, 64, 1, "hot"),  # a token routed twice to one expert; experts left empty
])
def test_packed_experts_in_blocks_match_float64(t, k, n_exp, group, planes, routing):
    """More pairs than experts off a GPU: `moe_experts_1bit(impl="xla")` unpacks each expert per block of its rows
    (moe_experts_1bit_blocks), against float64 numpy on the dequantized planes, as the per-pair XLA form is."""
    import pallas_kernels as pk
    from kernels.test_onebit_kernel import make_case, numpy_reference, rel_err

    x, ids, w, gu, dn = make_case(t + n_exp, 64, 96, n_exp, t, k, group, planes, routing)
    assert ids.size > n_exp
    want = numpy_reference(x, ids, w, gu, dn)
    got = jax.jit(lambda *a: pk.moe_experts_1bit(*a, gu, dn, impl="xla"))(x, ids, w)
    per_pair = pk.moe_experts_1bit_xla(x, ids, w, pk.as_packed(gu), pk.as_packed(dn))
    assert rel_err(got, want) < 1e-5 and rel_err(per_pair, want) < 1e-5
