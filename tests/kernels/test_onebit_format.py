"""The packed 1-bit / multi-plane expert format and its numpy quantizer."""

import numpy as np
import pytest

from pallas_kernels.onebit_format import BF16, PackedExperts
from strata_jax.weights.onebit import dequantize_experts, quantize_experts, reconstruction_error


def _w(shape, seed=0, dist="normal"):
    rng = np.random.default_rng(seed)
    if dist == "t":
        return rng.standard_t(3, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("group", [64, 128, 256])
def test_layout_and_sign_round_trip(group):
    e, n, k = 3, 40, 512
    w = _w((e, n, k), seed=group)
    q = quantize_experts(w, group=group, planes=1)
    assert q.bits.dtype == np.uint32 and q.bits.shape == (e, 1, k // 32, n)
    assert q.scales.dtype == BF16 and q.scales.shape == (e, 1, k // group, n)
    assert q.bits.flags.c_contiguous
    # bit j of word wd of (expert, output n) is the sign of input 32*wd + j (LSB first), 1 = positive
    wd = np.arange(k) // 32
    j = (np.arange(k) % 32).astype(np.uint32)
    bit = (q.bits[:, 0][:, wd, :] >> j[None, :, None]) & 1  # [e, k, n]
    np.testing.assert_array_equal(bit.transpose(0, 2, 1).astype(bool), w >= 0)
    # and the dequantized signs match exactly
    d = dequantize_experts(q)
    np.testing.assert_array_equal(np.sign(d), np.where(w >= 0, 1.0, -1.0))


def test_explicit_word_value():
    # one expert, one output, 64 inputs: positive exactly at inputs 0, 3, 33 -> word0 = 0b1001, word1 = 0b10
    w = -np.ones((1, 1, 64), np.float32)
    w[0, 0, [0, 3, 33]] = 1.0
    q = quantize_experts(w, group=64, planes=1)
    assert q.bits[0, 0, :, 0].tolist() == [0b1001, 0b10]
    assert float(q.scales[0, 0, 0, 0]) == 1.0


@pytest.mark.parametrize("group", [64, 128])
def test_scale_is_squared_error_optimal(group):
    w = _w((2, 16, 256), seed=3, dist="t")
    q = quantize_experts(w, group=group, planes=1)
    ng = 256 // group
    want = np.abs(w).reshape(2, 16, ng, group).mean(-1)  # closed form: mean |w| per group
    np.testing.assert_allclose(q.scales[:, 0].astype(np.float32), want.transpose(0, 2, 1).astype(BF16).astype(np.float32))
    # any perturbation of one group's scale increases that group's squared error
    base = ((dequantize_experts(q) - w) ** 2).sum()
    for f in (0.97, 1.03):
        s2 = q.scales.copy()
        s2[0, 0, 0, 0] = (s2[0, 0, 0, 0].astype(np.float32) * f).astype(BF16)
        q2 = PackedExperts(q.bits, s2, group)
        assert ((dequantize_experts(q2) - w) ** 2).sum() > base


@pytest.mark.parametrize("dist", ["normal", "t"])
def test_error_decreases_with_planes(dist):
    w = _w((4, 64, 512), seed=5, dist=dist)
    errs = [reconstruction_error(w, quantize_experts(w, 128, p)) for p in (1, 2, 3, 4)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert 0.55 < errs[0] < 0.8  # 1-bit of a Gaussian: sqrt(1 - 2/pi) ~ 0.60
    # prefixes of the planes are the greedy residual fits: using fewer planes of a 3-plane pack is worse
    q3 = quantize_experts(w, 128, 3)
    e_by_prefix = [reconstruction_error(w, q3, planes=p) for p in (1, 2, 3)]
    assert e_by_prefix[0] > e_by_prefix[1] > e_by_prefix[2]


def test_refit_never_hurts():
    w = _w((2, 64, 512), seed=7, dist="t")
    e0 = reconstruction_error(w, quantize_experts(w, 128, 2, refit_rounds=0))
    e3 = reconstruction_error(w, quantize_experts(w, 128, 2, refit_rounds=3))
    e8 = reconstruction_error(w, quantize_experts(w, 128, 2, refit_rounds=8))
    assert e8 <= e3 * (1 + 1e-3) and e3 < e0


def test_partial_last_group_and_chunking():
    w = _w((5, 24, 640), seed=9)  # 640 inputs, group 256 -> groups of 256, 256, 128
    q = quantize_experts(w, group=256, planes=2)
    assert q.scales.shape == (5, 2, 3, 24)
    q0 = quantize_experts(w, group=256, planes=1)
    want_last = np.abs(w[..., 512:]).mean(-1)  # first plane's last scale: mean over the 128 real inputs
    np.testing.assert_allclose(q0.scales[:, 0, 2].astype(np.float32), want_last.astype(BF16).astype(np.float32))
    q_small = quantize_experts(w, group=256, planes=2, chunk_bytes=1)  # one expert per chunk
    np.testing.assert_array_equal(q.bits, q_small.bits)
    np.testing.assert_array_equal(q.scales.view(np.uint16), q_small.scales.view(np.uint16))
    assert reconstruction_error(w, q) < 0.4


def test_zero_and_negative_zero_signs():
    w = np.zeros((1, 2, 32), np.float32)
    w[0, 1] = -0.0
    q = quantize_experts(w, 32, 1)
    assert q.bits[0, 0, 0, 0] == 0xFFFFFFFF and q.bits[0, 0, 0, 1] == 0
    assert np.all(dequantize_experts(q) == 0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        quantize_experts(np.zeros((1, 4, 48), np.float32))  # in % 32
    with pytest.raises(ValueError):
        quantize_experts(np.zeros((1, 4, 64), np.float32), group=48)
    with pytest.raises(ValueError):
        PackedExperts(np.zeros((1, 1, 2, 4), np.uint32), np.zeros((1, 1, 2, 4), BF16), 64)  # 64 in -> 1 group


def test_bytes_and_properties():
    q = quantize_experts(_w((2, 32, 256)), 128, 2)
    assert q.shape == (2, 32, 256) and q.planes == 2 and q.group == 128
    assert q.nbytes == 2 * 2 * (256 // 32 * 32 * 4 + 2 * 32 * 2)
    assert q.expert(1).bits.shape == (1, 2, 8, 32)


def test_jnp_dequantize_matches_numpy():
    jnp = pytest.importorskip("jax.numpy")
    from pallas_kernels.onebit_common import as_packed
    from pallas_kernels.onebit_format import dequantize

    w = _w((3, 48, 320), seed=11)
    q = quantize_experts(w, 64, 3)
    np.testing.assert_allclose(np.asarray(dequantize(as_packed(q))), dequantize_experts(q), rtol=1e-6, atol=1e-7)
    ids = jnp.asarray([[2, 0]])
    np.testing.assert_allclose(np.asarray(dequantize(as_packed(q), ids))[0, 0], dequantize_experts(q)[2], rtol=1e-6)
