"""The numpy host experts (LUT formulation) against an independent float64 dequantize-and-matmul reference."""

from __future__ import annotations

import concurrent.futures

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import PackedExperts, moe_experts_1bit_reference
from strata_jax.host.experts_numpy import (
    NumpyStack,
    byte_tables,
    group_sums,
    host_experts,
    project,
    project_blocked,
)


def _packed(rng, e, p, k, n, g):
    bits = rng.integers(0, 2**32, (e, p, k // 32, n), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.01, 0.05, (e, p, -(-k // g), n)).astype(ml_dtypes.bfloat16)
    return bits, scales


def numpy_stack(gb, gs, db, ds, group, layout="words") -> NumpyStack:
    """A layer's numpy host stack from its four arrays (bits in `layout`)."""
    return NumpyStack(PackedExperts(gb, gs, group, layout), PackedExperts(db, ds, group, layout))


def _dense64(bits, scales, g):
    """float64 [E, N, K] from the packed planes, bit by bit (docs/FORMATS.md reconstruction)."""
    e, p, kw, n = bits.shape
    k = kw * 32
    signs = ((bits[:, :, :, None, :] >> np.arange(32, dtype=np.uint32)[:, None]) & 1).reshape(e, p, k, n)
    signs = signs.astype(np.float64) * 2 - 1
    sc = np.repeat(scales.astype(np.float64), g, axis=2)[:, :, :k]
    return np.swapaxes((signs * sc).sum(axis=1), 1, 2)


def _reference64(x, ids, w, mask, gu, dn):
    inter = dn.shape[2]
    out = np.zeros((x.shape[0], dn.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if mask[t, j]:
                h = gu[ids[t, j]] @ x[t]
                a = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
                out[t] += w[t, j] * (dn[ids[t, j]] @ a)
    return out


# (experts, planes, hidden, intermediate, group, tokens, top-k); the last: many tokens per expert, the blocked path.
REFERENCE_CASES = [(8, 1, 256, 96, 64, 5, 3), (6, 2, 320, 64, 128, 4, 2), (12, 3, 512, 160, 256, 7, 4),
                   (4, 4, 128, 32, 64, 1, 2), (2, 2, 384, 96, 256, 40, 2)]


def reference_case(e, planes, hidden, inter, group, tokens, k):
    """Random packed experts ((gate_up bits, scales, down bits, scales) as packed words), a routing x, ids, w and
    a host mask (row 0's first pair always set), and the float64 reference output."""
    rng = np.random.default_rng(e * 100 + planes)
    gb, gs = _packed(rng, e, planes, hidden, 2 * inter, group)
    db, ds = _packed(rng, e, planes, inter, hidden, group)
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = rng.uniform(size=(tokens, k)).astype(np.float32)
    mask = rng.uniform(size=(tokens, k)) < 0.6
    mask[0, 0] = True
    ref = _reference64(x.astype(np.float64), ids, w, mask, _dense64(gb, gs, group), _dense64(db, ds, group))
    return (gb, gs, db, ds), x, ids, w, mask, ref


@pytest.mark.parametrize("e,planes,hidden,inter,group,tokens,k", REFERENCE_CASES)
def test_matches_float64_reference(e, planes, hidden, inter, group, tokens, k):
    (gb, gs, db, ds), x, ids, w, mask, ref = reference_case(e, planes, hidden, inter, group, tokens, k)
    stack = numpy_stack(gb, gs, db, ds, group)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = host_experts(stack, x, ids, w, mask, pool)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert np.all(got[~mask.any(axis=1)] == 0)
    # And against the kernels' own reference where every pair is on the host.
    full = host_experts(stack, x, ids, w, np.ones_like(mask))
    kref = moe_experts_1bit_reference(
        jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w),
        PackedExperts(jnp.asarray(gb), jnp.asarray(gs), group), PackedExperts(jnp.asarray(db), jnp.asarray(ds), group),
    )
    np.testing.assert_allclose(full, np.asarray(kref), rtol=1e-4, atol=1e-5 * np.abs(full).max())


@pytest.mark.parametrize("planes,k,n,group", [(1, 256, 96, 64), (2, 640, 160, 256), (3, 320, 64, 128)])
def test_table_and_blocked_projections_agree(planes, k, n, group):
    rng = np.random.default_rng(planes)
    bits, scales = _packed(rng, 1, planes, k, n, group)
    x = rng.normal(size=(5, k)).astype(np.float32)
    xsum = group_sums(x, group)
    a = project(byte_tables(x), xsum, bits[0], scales[0], group)
    b = project_blocked(x, xsum, bits[0], scales[0], group)
    ref = x.astype(np.float64) @ _dense64(bits, scales, group)[0].T
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(b, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 9])
@pytest.mark.parametrize("planes,k,n,group", [(1, 2560 // 8, 96, 128), (2, 320, 72, 128), (2, 640, 40, 256)])
def test_table_projection_token_counts(tokens, planes, k, n, group):
    """The table path for every item width (1, 2, 4 tokens gathered at once, 3 padded, >4 chunked), with a short
    last scale group (k % group) and 2 planes, against float64; and one expert fed `tokens` rows via host_experts."""
    rng = np.random.default_rng(tokens * 10 + planes)
    bits, scales = _packed(rng, 1, planes, k, n, group)
    x = rng.normal(size=(tokens, k)).astype(np.float32)
    got = project(byte_tables(x), group_sums(x, group), bits[0], scales[0], group)
    ref = x.astype(np.float64) @ _dense64(bits, scales, group)[0].T
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # Whole expert, all tokens on expert 0 (table path while tokens < BLOCKED_MIN_TOKENS).
    gb, gs = _packed(rng, 1, planes, k, 2 * 64, group)
    db, ds = _packed(rng, 1, planes, 64, k, group)
    stack = numpy_stack(gb, gs, db, ds, group)
    ids = np.zeros((tokens, 1), np.int32)
    w = rng.uniform(size=(tokens, 1)).astype(np.float32)
    mask = np.ones((tokens, 1), bool)
    ref = _reference64(x.astype(np.float64), ids, w, mask, _dense64(gb, gs, group), _dense64(db, ds, group))
    got = host_experts(stack, x, ids, w, mask)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    lut, xsum = byte_tables(x), group_sums(x, group)
    np.testing.assert_allclose(stack.expert_output(0, x, lut, xsum) * w, got, rtol=1e-5, atol=1e-6)


def test_no_pairs_gives_zeros():
    rng = np.random.default_rng(1)
    gb, gs = _packed(rng, 3, 1, 64, 64, 64)
    db, ds = _packed(rng, 3, 1, 32, 64, 64)
    stack = numpy_stack(gb, gs, db, ds, 64)
    out = host_experts(stack, np.ones((2, 64), np.float32), np.zeros((2, 1), np.int32), np.ones((2, 1)),
                       np.zeros((2, 1), bool))
    assert out.shape == (2, 64) and not out.any()
