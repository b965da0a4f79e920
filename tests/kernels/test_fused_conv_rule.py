"""The causal conv folded into the gated delta rule (pallas_kernels.delta_rule.gated_delta_conv_decode): the Pallas
kernel (interpret mode on CPU, cross-lowered for CUDA, the real thing on a GPU) against the model's conv + rule and
a float64 numpy conv; padding tokens leave the conv tail as the model leaves it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import delta_rule
from strata_jax.model.conv import causal_conv


def _inputs(b, t, hk, hv, dk, dv, dtype, seed, kernel=4):
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    arrays = (rng.normal(size=(b, t, c)), rng.normal(size=(b, c, kernel - 1)), rng.normal(size=(c, kernel)) * 0.5)
    x, conv_state, weight = (jnp.asarray(a, dtype) for a in arrays)
    g = jnp.asarray(-rng.uniform(0, 0.5, size=(b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, size=(b, t, hv)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
    n_valid = jnp.asarray(rng.integers(0, t + 1, size=b), jnp.int32).at[0].set(t)
    valid = (jnp.arange(t)[None, :] < n_valid[:, None])[..., None]  # the model zeroes g and beta past n_valid
    return x, conv_state, weight, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0), state, n_valid


def _model_path(x, conv_state, weight, g, beta, state, n_valid, hk):
    """What `GatedDeltaNet` runs without the switch: `causal_conv`, SiLU, `gated_delta_decode` (jnp)."""
    conv, tail = causal_conv(x, conv_state, weight, n_valid)
    qkv = (conv.astype(jnp.float32) / (1 + jnp.exp(-conv.astype(jnp.float32)))).astype(x.dtype)
    out, new_state = delta_rule.gated_delta_decode(qkv, g, beta, state, k_heads=hk, impl="jnp")
    return out, qkv, tail, new_state


def _numpy_conv(x, conv_state, weight, n_valid):
    """float64: out[t, c] = sum_j w[c, j] * [tail | x][t + j, c]; the new tail is [tail | x][n : n + L]."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    xs = np.concatenate([f64(conv_state), np.swapaxes(f64(x), 1, 2)], axis=-1)
    w = f64(weight)
    kernel, t = w.shape[1], x.shape[1]
    out = sum(w[None, :, j : j + 1] * xs[:, :, j : j + t] for j in range(kernel))
    tails = np.stack([xs[b, :, n : n + kernel - 1] for b, n in enumerate(np.asarray(n_valid))])
    return np.swapaxes(out, 1, 2), tails


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,block_v", [(2, 1, 2, 4, 16, 32, 16), (3, 3, 1, 2, 16, 16, 16),
                                                     (2, 5, 2, 2, 16, 32, 32)])
def test_matches_the_model_path_and_numpy_f32(b, t, hk, hv, dk, dv, block_v):
    """Every output (rule output, activated conv output, conv tail, state) equals the model's conv + rule, padded rows
    included; the conv itself equals float64 numpy."""
    args = _inputs(b, t, hk, hv, dk, dv, jnp.float32, seed=b * 10 + t)
    got = jax.jit(lambda *a: delta_rule.gated_delta_conv_decode(*a, k_heads=hk, impl="pallas", block_v=block_v,
                                                                interpret=True))(*args)
    want = _model_path(*args, hk)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    conv, tails = _numpy_conv(*args[:3], args[6])
    np.testing.assert_allclose(np.asarray(got[1]), conv / (1 + np.exp(-conv)), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), tails.astype(np.float32))


def test_bf16_projection_and_tail():
    """bf16 raw projection, tail and weight: the activated conv output and the tail are bf16 and equal the model's
    (the conv adds in float32 in the same order; the tail is a copy), the rule within float32 rounding."""
    args = _inputs(2, 4, 2, 4, 16, 16, jnp.bfloat16, seed=3)
    got = jax.jit(lambda *a: delta_rule.gated_delta_conv_decode(*a, k_heads=2, impl="pallas", block_v=16,
                                                                interpret=True))(*args)
    want = _model_path(*args, 2)
    assert got[1].dtype == got[2].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32), rtol=1e-2, atol=1e-2)
    for g, w in ((got[0], want[0]), (got[3], want[3])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-2, atol=2e-2)


def test_bad_shapes():
    x, conv_state, weight, g, beta, state, n_valid = _inputs(1, 1, 1, 1, 16, 16, jnp.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        delta_rule.gated_delta_conv_decode(x, conv_state[:, :, :2], weight, g, beta, state, n_valid, k_heads=1)
    with pytest.raises(ValueError, match="channels"):
        delta_rule.gated_delta_conv_decode(x, conv_state, weight, g, beta, state, n_valid, k_heads=2, impl="pallas")


@pytest.mark.parametrize("b,t", [(1, 1), (32, 4)])
def test_lowers_to_one_triton_kernel_without_a_gpu(b, t):
    """Interpret mode skips the Pallas -> Triton lowering; lowering for CUDA on the CPU runs it (Flash-Next's
    shapes: 16 key heads, 48 value heads of 128, conv kernel 4, bf16 projection; decode and a verify window). Beside
    the kernel only g and beta are stacked into one array, as for `gated_delta_decode`."""
    args = [jnp.zeros(a.shape, a.dtype) for a in _inputs(b, t, 16, 48, 128, 128, jnp.bfloat16, seed=0)]
    f = jax.jit(lambda *a: delta_rule.gated_delta_conv_decode(*a, k_heads=16, impl="pallas"))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    ops = set(re.findall(r"stablehlo\.([a-z_]+)", text))
    assert ops <= {"custom_call", "reshape", "concatenate", "broadcast_in_dim", "output_operand_alias", "return"}, ops


@pytest.mark.gpu
@pytest.mark.parametrize("b,t", [(1, 1), (8, 4)])
def test_kernel_on_gpu_at_flash_next_shapes(b, t):
    args = _inputs(b, t, 16, 48, 128, 128, jnp.bfloat16, seed=t)
    got = jax.jit(lambda *a: delta_rule.gated_delta_conv_decode(*a, k_heads=16, impl="pallas"))(*args)
    want = jax.jit(lambda *a: _model_path(*a, 16))(*args)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=3e-2, atol=3e-2)
