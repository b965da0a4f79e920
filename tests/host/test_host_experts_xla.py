"""The XLA:CPU host experts against the float64 dequantize-and-matmul reference of test_host_experts, the byte-major
layout against the packed words, and the tier's kernel switch."""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest
from test_host_experts import REFERENCE_CASES, _dense64, _packed, _reference64, numpy_stack, reference_case

from pallas_kernels.onebit_format import PackedExperts, bytes_to_words, words_to_bytes
from strata_jax.host import tier as host_tier
from strata_jax.host.experts_numpy import NumpyStack, host_experts
from strata_jax.host.experts_xla import DENSE_MIN_TOKENS, XlaStack, host_experts_xla
from strata_jax.host.pool import KERNELS, HostPool


def _xla_stack(gb, gs, db, ds, group):
    gb, gs, db, ds = (jax.device_put(a) for a in (words_to_bytes(gb), gs, words_to_bytes(db), ds))
    return XlaStack(PackedExperts(gb, gs, group, "bytes"), PackedExperts(db, ds, group, "bytes"))


def _stacks(rng, e, planes, hidden, inter, group):
    gb, gs = _packed(rng, e, planes, hidden, 2 * inter, group)
    db, ds = _packed(rng, e, planes, inter, hidden, group)
    return (gb, gs, db, ds), _xla_stack(gb, gs, db, ds, group)


def test_byte_major_layout():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, (3, 2, 5, 7), dtype=np.uint64).astype(np.uint32)
    byts = words_to_bytes(words)
    assert byts.shape == (3, 2, 20, 7) and byts.dtype == np.uint8
    # Row 4w + b holds bits 8b .. 8b + 7 of word w.
    assert np.array_equal(byts[:, :, 4 * 3 + 2], (words[:, :, 3] >> 16) & 0xFF)
    assert np.array_equal(bytes_to_words(byts), words)


@pytest.mark.parametrize("e,planes,hidden,inter,group,tokens,k", REFERENCE_CASES)  # the last: the dense path
def test_matches_float64_reference(e, planes, hidden, inter, group, tokens, k):
    (gb, gs, db, ds), x, ids, w, mask, ref = reference_case(e, planes, hidden, inter, group, tokens, k)
    stack = _xla_stack(gb, gs, db, ds, group)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = host_experts_xla(stack, x, ids, w, mask, pool)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert np.all(got[~mask.any(axis=1)] == 0)
    # The numpy path reads the byte-major layout as well as the packed words.
    numpy_bytes = numpy_stack(words_to_bytes(gb), gs, words_to_bytes(db), ds, group, "bytes")
    np.testing.assert_allclose(host_experts(numpy_bytes, x, ids, w, mask), got, rtol=1e-4,
                               atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, DENSE_MIN_TOKENS - 1, DENSE_MIN_TOKENS + 1])
def test_every_token_bucket_of_one_expert(tokens):
    """Tables for small buckets (padded rows must not leak into real ones), dense from DENSE_MIN_TOKENS on."""
    rng = np.random.default_rng(tokens)
    (gb, gs, db, ds), stack = _stacks(rng, 3, 2, 256, 64, 128)
    x = rng.normal(size=(tokens, 256)).astype(np.float32)
    ids = np.full((tokens, 1), 2, np.int32)
    w = rng.uniform(size=(tokens, 1)).astype(np.float32)
    mask = np.ones((tokens, 1), bool)
    ref = _reference64(x.astype(np.float64), ids, w, mask, _dense64(gb, gs, 128), _dense64(db, ds, 128))
    got = host_experts_xla(stack, x, ids, w, mask)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_no_pairs_gives_zeros():
    _, stack = _stacks(np.random.default_rng(1), 3, 1, 64, 32, 64)
    out = host_experts_xla(stack, np.ones((2, 64), np.float32), np.zeros((2, 1), np.int32), np.ones((2, 1)),
                           np.zeros((2, 1), bool))
    assert out.shape == (2, 64) and not out.any()


def test_tier_kernels_agree_and_rows_keep_the_checkpoint_layout():
    rng = np.random.default_rng(3)
    gb, gs = _packed(rng, 5, 1, 128, 64, 64)
    db, ds = _packed(rng, 5, 1, 32, 128, 64)
    x = rng.normal(size=(3, 128)).astype(np.float32)
    ids = np.asarray([[0, 4], [1, 2], [3, 4]], np.int32)
    w = rng.uniform(size=(3, 2)).astype(np.float32)
    mask = np.asarray([[True, False], [True, True], [False, True]])
    outs = {}
    for kernel in KERNELS:
        tier = host_tier.HostTier(64, HostPool(kernel=kernel))
        for name, array in zip(tier._KINDS, (gb, gs, db, ds)):
            tier.set(name, array)
        assert tier.kernel == kernel
        outs[kernel] = tier.compute(x, ids, w, mask)
        assert np.array_equal(tier.rows("gate_up_bits", np.asarray([4, 1])), gb[[4, 1]])
        assert np.array_equal(tier.rows("down_scales", np.asarray([2])), ds[[2]])
    np.testing.assert_allclose(outs["xla"], outs["numpy"], rtol=1e-4, atol=1e-5 * np.abs(outs["numpy"]).max())
    with pytest.raises(ValueError, match="host kernel"):
        HostPool(kernel="cuda")


def test_tier_without_a_cpu_backend_falls_back_to_numpy(monkeypatch):
    """JAX_PLATFORMS=cuda leaves no XLA CPU device: the tier warns (once) and computes in numpy."""
    rng = np.random.default_rng(4)
    gb, gs = _packed(rng, 3, 1, 64, 64, 64)
    db, ds = _packed(rng, 3, 1, 32, 64, 64)
    monkeypatch.setattr(host_tier, "_cpu_device", lambda: None)
    tier = host_tier.HostTier(64, HostPool())
    with pytest.warns(UserWarning, match="fall back to numpy"):
        tier.set("gate_up_bits", gb)
    for name, array in zip(tier._KINDS[1:], (gs, db, ds)):
        tier.set(name, array)
    assert tier.kernel == "numpy" and isinstance(tier.stack, NumpyStack)
    x, ids, w = rng.normal(size=(1, 64)).astype(np.float32), np.asarray([[2]]), np.ones((1, 1))
    mask = np.ones((1, 1), bool)
    expected = host_experts(numpy_stack(gb, gs, db, ds, 64), x, ids, w, mask)
    np.testing.assert_allclose(tier.compute(x, ids, w, mask), expected, rtol=1e-6)
    with pytest.raises(RuntimeError, match="CPU backend"):
        tier.use_kernel("xla")
