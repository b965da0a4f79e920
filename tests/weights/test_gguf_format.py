"""GGUF expert types -> our packed planes, against independent references: ggml's own Q1_0 definition written out
here (ggml-quants.c dequantize_row_q1_0), and the `gguf` package's quantizers / dequantizers for the ternary types."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from pallas_kernels.onebit_format import BF16, pack_signs
from strata_jax.weights.gguf_convert import exact_planes, lift
from strata_jax.weights.gguf_reader import TensorInfo, dequantize_q1_0
from strata_jax.weights.onebit import dequantize_experts


def _q1_0_reference(raw: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q1_0, element by element."""
    out = []
    for row in raw.reshape(-1, raw.shape[-1]):
        vals = []
        for b in range(row.size // 18):
            blk = row[18 * b : 18 * b + 18]
            d = float(blk[:2].view(np.float16)[0])
            for j in range(128):
                bit = (int(blk[2 + j // 8]) >> (j % 8)) & 1
                vals.append(d if bit else -d)
        out.append(vals)
    return np.asarray(out, np.float32).reshape(*raw.shape[:-1], -1)


def _random_q1_0(rng, e: int, n: int, k: int, bf16_scales: bool) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(e, n, k // 128, 18), dtype=np.uint8)
    d = rng.uniform(0.01, 0.2, size=(e, n, k // 128)).astype(np.float32)
    if bf16_scales:  # scales bf16 can hold exactly: the mapping must then be exact to the bit
        d = d.astype(BF16).astype(np.float32)
    blocks[..., :2] = d.astype(np.float16).view(np.uint8).reshape(e, n, k // 128, 2)
    return blocks.reshape(e, n, -1)


def _info(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo("blk.0.ffn_gate_exps.weight", qtype, shape, raw, None)


def test_q1_0_dequantize_matches_ggml_definition():
    raw = _random_q1_0(np.random.default_rng(0), 1, 3, 256, bf16_scales=False)
    np.testing.assert_array_equal(dequantize_q1_0(raw), _q1_0_reference(raw))


def test_q1_0_maps_bit_for_bit_onto_one_plane():
    rng = np.random.default_rng(1)
    e, n, k = 2, 5, 256
    raw = _random_q1_0(rng, e, n, k, bf16_scales=True)
    packed = exact_planes(_info(raw, QType.Q1_0, (e, n, k)))
    assert (packed.planes, packed.group) == (1, 128)
    want = _q1_0_reference(raw)
    np.testing.assert_array_equal(dequantize_experts(packed), want)
    # the bits are our words: bit j of word w <-> input 32 w + j, 1 -> +scale
    np.testing.assert_array_equal(packed.bits[:, 0], pack_signs(want > 0))


def test_q1_0_scale_rounding_is_the_only_error():
    rng = np.random.default_rng(2)
    raw = _random_q1_0(rng, 1, 4, 128, bf16_scales=False)
    packed = exact_planes(_info(raw, QType.Q1_0, (1, 4, 128)))
    want = _q1_0_reference(raw)
    got = dequantize_experts(packed)
    np.testing.assert_array_equal(np.sign(got), np.sign(want))
    assert np.max(np.abs(got - want) / np.abs(want)) <= 2.0**-8


@pytest.mark.parametrize("qtype", [QType.TQ1_0, QType.TQ2_0])
def test_ternary_is_two_sign_planes_at_half_scale(qtype):
    rng = np.random.default_rng(3)
    e, n, k = 2, 3, 512
    w = rng.standard_normal((e, n, k)).astype(np.float32)
    raw = quants.quantize(w.reshape(e * n, k), qtype).reshape(e, n, -1)
    want = quants.dequantize(raw.reshape(e * n, -1), qtype).reshape(e, n, k)
    packed = exact_planes(_info(raw, qtype, (e, n, k)))
    assert (packed.planes, packed.group) == (2, 256)
    got = dequantize_experts(packed)
    assert set(np.unique(np.round(want / np.abs(want).max(), 6))) >= {0.0}  # really ternary, zeros included
    np.testing.assert_array_equal(np.sign(got), np.sign(want))
    nz = want != 0
    assert np.max(np.abs(got[nz] - want[nz]) / np.abs(want[nz])) <= 2.0**-8


def test_lift_is_exact():
    rng = np.random.default_rng(4)
    raw = _random_q1_0(rng, 2, 4, 512, bf16_scales=True)
    packed = exact_planes(_info(raw, QType.Q1_0, (2, 4, 512)))
    lifted = lift(packed, planes=3, group=64)
    assert (lifted.planes, lifted.group) == (3, 64)
    np.testing.assert_array_equal(dequantize_experts(lifted), dequantize_experts(packed))
    with pytest.raises(ValueError):
        lift(lifted, planes=1, group=64)
