"""The gated delta rule, chunked and recurrent, against a float64 numpy recurrence, from a non-zero state; and the
Pallas kernel of the recurrent form (interpret mode on CPU, cross-lowered for CUDA, the real thing on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltanet_helpers import rule_inputs
from pallas_kernels import delta_rule
from pallas_kernels.delta_rule import recurrent_rule_jnp
from strata_jax.model.deltanet import chunk_gated_delta_rule


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


def _inputs(t, seed, dk=8, dv=5):
    return rule_inputs(2, t, 3, dk, dv, seed)


@pytest.mark.parametrize("t", [1, 5, 64, 150])
@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_rule_jnp])
def test_rule_matches_numpy(rule, t):
    args = _inputs(t, seed=t)
    want_out, want_state = _numpy_rule(*args)
    out, state = jax.jit(rule)(*args)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("prep_impl", ["jnp", "pallas"])
def test_chunked_rule_through_the_kernels_matches_numpy(prep_impl):
    """150 tokens in chunks of 64 (the last padded), the inter-chunk recurrence in `pallas_kernels.delta_chunk`'s
    kernel, the per-chunk part in XLA or in `pallas_kernels.delta_prep`'s kernel (interpret mode; Triton wants
    power-of-two head dims of at least 16)."""
    args = _inputs(150, seed=5, dk=16, dv=32)
    want_out, want_state = _numpy_rule(*args)
    out, state = jax.jit(lambda *a: chunk_gated_delta_rule(*a, scan_impl="pallas", prep_impl=prep_impl))(*args)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("scan_precision", ["tf32x3", "tf32"])
def test_chunked_rule_through_both_kernels_on_gpu(scan_precision, monkeypatch):
    """Flash-Next's head dims, 1,000 tokens (the last chunk padded), both kernels compiled, against float64: with
    three TF32 passes no further from it than twice the XLA forms' error; with one, within 1e-3 (H100, 2026-12-07:
    6.8e-5 in the output and 2.7e-4 in the state against XLA's 1e-7 and 2.6e-7), below the bfloat16 the rule's
    output is rounded to next (4e-3)."""
    from pallas_kernels import delta_chunk

    monkeypatch.setattr(delta_chunk, "KERNEL_PRECISION", scan_precision)
    args = _inputs(1000, seed=6, dk=128, dv=128)
    want_out, want_state = _numpy_rule(*args)
    got = jax.jit(lambda *a: chunk_gated_delta_rule(*a, scan_impl="pallas", prep_impl="pallas"))(*args)
    ref = jax.jit(lambda *a: chunk_gated_delta_rule(*a, scan_impl="jnp", prep_impl="jnp"))(*args)
    for g, r, w in zip(got, ref, (want_out, want_state)):
        err, ref_err = np.abs(np.asarray(g) - w).max(), np.abs(np.asarray(r) - w).max()
        print(f"scan {scan_precision}: kernels {err:.2e}, XLA {ref_err:.2e}")
        assert err <= (2 * ref_err + 1e-5 if scan_precision == "tf32x3" else 1e-3), (err, ref_err)


@pytest.mark.parametrize("scan_impl", ["jnp", "assoc", "states"])
@pytest.mark.parametrize("precision", [None, jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6])
def test_chunked_rule_per_scan_form_and_precision_matches_numpy(scan_impl, precision):
    """300 tokens (5 chunks, the last padded) through each scan form, the UT system in full float32 or six bf16
    passes (`bench --mode deltanet` measures which is faster on a GPU)."""
    args = _inputs(300, seed=11, dk=16, dv=32)
    want_out, want_state = _numpy_rule(*args)
    out, state = jax.jit(lambda *a: chunk_gated_delta_rule(*a, scan_impl=scan_impl, precision=precision))(*args)
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


def _decode_inputs(b, t, hk, hv, dk, dv, seed):
    """The kernel's inputs: the activated conv output qkv [B, T, 2*Hk*Dk + Hv*Dv], g, beta [B, T, Hv], a state."""
    rng = np.random.default_rng(seed)
    qkv = rng.normal(size=(b, t, 2 * hk * dk + hv * dv))
    g = -rng.uniform(0.0, 0.5, size=(b, t, hv))
    beta = rng.uniform(0, 1, size=(b, t, hv))
    state = rng.normal(size=(b, hv, dk, dv))
    return [x.astype(np.float32) for x in (qkv, g, beta, state)]


def _decode_reference(qkv, g, beta, state, hk):
    """float64 numpy: split the channels, L2-normalise q and k per key head, scale q, share each key head among
    Hv/Hk value heads, then the recurrence."""
    b, t, _ = qkv.shape
    hv, dk, dv = state.shape[1:]
    qkv = qkv.astype(np.float64)
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk], axis=-1)
    norm = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    q = np.repeat(norm(q.reshape(b, t, hk, dk)), hv // hk, axis=2) * dk**-0.5
    k = np.repeat(norm(k.reshape(b, t, hk, dk)), hv // hk, axis=2)
    return _numpy_rule(q, k, v.reshape(b, t, hv, dv), g.astype(np.float64), beta.astype(np.float64), state)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("b,t,hk,hv,dk,dv,block_v", [(3, 1, 2, 2, 16, 32, 16), (2, 3, 2, 4, 32, 32, 32),
                                                     (1, 8, 1, 3, 8, 64, 16)])
def test_decode_kernel_matches_numpy(impl, b, t, hk, hv, dk, dv, block_v):
    args = _decode_inputs(b, t, hk, hv, dk, dv, seed=b + t + hv)
    want_out, want_state = _decode_reference(*args, hk)
    f = jax.jit(lambda *a: delta_rule.gated_delta_decode(*a, k_heads=hk, impl=impl, block_v=block_v,
                                                         interpret=True))
    out, state = f(*args)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=1e-5, atol=1e-5)


def test_decode_kernel_reads_bf16_qkv():
    """The model hands over a bf16 conv output: the kernel upcasts it as the jnp form does."""
    qkv, g, beta, state = _decode_inputs(2, 2, 2, 4, 16, 16, seed=5)
    qkv = jnp.asarray(qkv, jnp.bfloat16)
    want_out, want_state = _decode_reference(np.asarray(qkv.astype(jnp.float32)), g, beta, state, 2)
    out, new_state = delta_rule.gated_delta_decode(qkv, g, beta, state, k_heads=2, impl="pallas", block_v=16,
                                                   interpret=True)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_state), want_state, rtol=1e-5, atol=1e-5)


def test_decode_kernel_with_donated_state_repeats():
    """Three calls through a jit that donates the state equal the float64 rule over all their tokens (the kernel
    writes the new state over the old one)."""
    qkv, g, beta, state0 = _decode_inputs(2, 6, 2, 4, 16, 32, seed=11)
    f = jax.jit(lambda *a: delta_rule.gated_delta_decode(*a, k_heads=2, impl="pallas", block_v=16, interpret=True),
                donate_argnums=3)
    state, outs = jnp.asarray(state0), []
    for lo in range(0, 6, 2):
        out, state = f(qkv[:, lo:lo + 2], g[:, lo:lo + 2], beta[:, lo:lo + 2], state)
        outs.append(np.asarray(out))
    want_out, want_state = _decode_reference(qkv, g, beta, state0, 2)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=1e-5, atol=1e-5)


def test_decode_kernel_impl_choice_and_bad_shapes():
    if jax.default_backend() != "gpu":
        assert delta_rule.resolve_impl("auto", 128, 128) == "jnp"
    assert delta_rule.resolve_impl("auto", 96, 128) == "jnp"  # not a power of two: never the kernel
    with pytest.raises(ValueError, match="impl must be"):
        delta_rule.resolve_impl("cuda", 128, 128)
    qkv, g, beta, state = _decode_inputs(1, 1, 1, 1, 12, 16, seed=1)
    with pytest.raises(ValueError, match="power-of-two"):
        delta_rule.gated_delta_decode(qkv, g, beta, state, k_heads=1, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="channels"):
        delta_rule.gated_delta_decode(qkv, g, beta, state, k_heads=2)


@pytest.mark.parametrize("t", [1, 4])
def test_decode_kernel_lowers_to_triton_without_a_gpu(t):
    """Interpret mode skips the Pallas -> Triton lowering; lowering for CUDA on the CPU runs it (Flash-Next's
    shapes at 32 slots, decode and a 4-token verify window, each with its default block)."""
    args = [jnp.zeros(a.shape, jnp.bfloat16 if i == 0 else a.dtype)
            for i, a in enumerate(_decode_inputs(32, t, 16, 48, 128, 128, seed=0))]
    f = jax.jit(lambda *a: delta_rule.gated_delta_decode(*a, k_heads=16, impl="pallas"))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_decode_kernel_on_gpu_at_flash_next_shapes(t):
    args = _decode_inputs(32, t, 16, 48, 128, 128, seed=t)
    out, state = jax.jit(lambda *a: delta_rule.gated_delta_decode(*a, k_heads=16, impl="pallas"))(*args)
    want_out, want_state = _decode_reference(*args, 16)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=1e-4, atol=1e-4)
