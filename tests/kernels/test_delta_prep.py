"""The chunked delta rule's per-chunk part as one Pallas kernel (pallas_kernels.delta_prep) against the model's XLA
form (`strata_jax.model.deltanet.chunk_prep_jnp`) and a float64 numpy form: interpret mode here, the Triton lowering
without a GPU, the compiled kernel on a GPU; the model's rule through it; its gradient through the XLA form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltanet_helpers import rule_inputs
from pallas_kernels import delta_prep
from pallas_kernels.delta_prep import chunk_prep
from strata_jax.model import deltanet
from strata_jax.model.deltanet import chunk_gated_delta_rule, chunk_prep_jnp


def _numpy_prep(q, k, v, g, beta, chunk):
    """Float64, with the UT system solved row by row (forward substitution), not inverted by a series."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, _ = k.shape
    outs = [[], [], [], [], [], []]
    for n in range(t // chunk):
        rows = slice(n * chunk, (n + 1) * chunk)
        qc, kc, vc = (np.moveaxis(x[:, rows], 2, 1) for x in (q, k, v))  # [B, H, C, D]
        gc, bc = (np.moveaxis(x[:, rows], 2, 1) for x in (g, beta))  # [B, H, C]
        cum = np.cumsum(gc, axis=-1)
        diff = cum[..., :, None] - cum[..., None, :]
        lower = np.tril(np.ones((chunk, chunk), bool))
        decay = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0)
        a = np.where(np.tril(lower, -1), np.einsum("bhik,bhjk->bhij", kc * bc[..., None], kc) * decay, 0.0)
        rhs_u, rhs_w = vc * bc[..., None], kc * (bc * np.exp(cum))[..., None]
        u, w = np.zeros_like(rhs_u), np.zeros_like(rhs_w)
        for i in range(chunk):  # (I + A) x = rhs, A strictly lower
            u[..., i, :] = rhs_u[..., i, :] - np.einsum("bhj,bhjd->bhd", a[..., i, :i], u[..., :i, :])
            w[..., i, :] = rhs_w[..., i, :] - np.einsum("bhj,bhjd->bhd", a[..., i, :i], w[..., :i, :])
        intra = np.where(lower, np.einsum("bhik,bhjk->bhij", qc, kc) * decay, 0.0)
        parts = (u, w, qc * np.exp(cum)[..., None], kc * np.exp(cum[..., -1:] - cum)[..., None], intra,
                 np.exp(cum[..., -1]))
        for out, part in zip(outs, parts):
            out.append(part)
    return [np.stack(o, axis=2) for o in outs]


def _inputs(b, t, h, dk, dv, seed):
    return rule_inputs(b, t, h, dk, dv, seed)[:5]


def _kernel_prep(q, k, v, g, beta, chunk, **kwargs):
    b, t, h, _ = k.shape
    by_chunk = lambda a: jnp.moveaxis(a.reshape(b, t // chunk, chunk, h), 3, 1)  # noqa: E731
    cum = jnp.cumsum(by_chunk(g), axis=-1)
    return (*chunk_prep(q, k, v, cum, by_chunk(beta), chunk=chunk, **kwargs), jnp.exp(cum[..., -1]))


@pytest.mark.parametrize("b,t,h,dk,dv,chunk", [(2, 48, 3, 16, 32, 16), (1, 64, 2, 32, 16, 64)])
def test_kernel_matches_the_xla_form_and_float64(b, t, h, dk, dv, chunk):
    args = [jnp.asarray(x) for x in _inputs(b, t, h, dk, dv, seed=t + h)]
    want = _numpy_prep(*args, chunk)
    got = _kernel_prep(*args, chunk, interpret=True)
    ref = chunk_prep_jnp(*args, chunk)
    names = ("u", "w", "q_dec", "k_dec", "intra", "decay")
    for name, g, r, w in zip(names, got, ref, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(r), w, rtol=2e-5, atol=2e-5, err_msg=name)


def test_the_rule_through_the_kernel_and_its_gradient():
    """The model's chunked rule with the kernel (a padded tail, a non-zero state) gives the XLA form's outputs and
    state; differentiating it goes through the XLA form."""
    q, k, v, g, beta = (jnp.asarray(x) for x in _inputs(1, 150, 2, 16, 16, seed=1))
    state = jnp.asarray(np.random.default_rng(2).normal(size=(1, 2, 16, 16)).astype(np.float32))
    want = chunk_gated_delta_rule(q, k, v, g, beta, state, prep_impl="jnp")
    got = chunk_gated_delta_rule(q, k, v, g, beta, state, prep_impl="pallas")
    for a, b_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-4, atol=1e-4)

    def loss(impl):
        return lambda v_: jnp.sum(jnp.sin(chunk_gated_delta_rule(q, k, v_, g, beta, state, prep_impl=impl)[0]))

    np.testing.assert_allclose(np.asarray(jax.grad(loss("pallas"))(v)), np.asarray(jax.grad(loss("jnp"))(v)),
                               rtol=1e-4, atol=1e-4)


def test_default_prep_is_xla_and_bad_inputs_are_refused(monkeypatch):
    assert deltanet.PREP_IMPL == "jnp"
    args = [jnp.asarray(x) for x in _inputs(1, 32, 2, 16, 16, seed=0)]
    by = jnp.zeros((1, 2, 2, 16))
    with pytest.raises(ValueError, match="multiple of 64"):
        chunk_prep(*args[:3], by, by, chunk=64, interpret=True)
    with pytest.raises(ValueError, match=r"cum and beta must be \[B, H, N, C\]"):
        chunk_prep(*args[:3], by[..., :8], by, chunk=16, interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        chunk_prep(*args[:3], jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 2, 4, 8)), chunk=8, interpret=True)
    with pytest.raises(ValueError, match="precision must be one of"):
        chunk_prep(*args[:3], by, by, chunk=16, precision="fp8", interpret=True)


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_lowers_to_one_triton_kernel_without_a_gpu(precision, monkeypatch):
    """Flash-Next's shapes (48 value heads, Dk = Dv = 128, a 4,096-token chunk in 64 chunks of 64)."""
    monkeypatch.setattr(delta_prep, "PRECISION", precision)
    sd = jax.ShapeDtypeStruct
    b, t, h, d, c = 1, 4096, 48, 128, 64
    shapes = [sd((b, t, h, d), jnp.float32)] * 3 + [sd((b, h, t // c, c), jnp.float32)] * 2
    f = jax.jit(lambda *a: chunk_prep(*a, chunk=c))
    text = f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_kernel_on_gpu_at_flash_next_shapes(precision="tf32x3", factor=2.0):
    """The compiled kernel (three TF32 passes, its default) against float64 at Flash-Next's head shapes: within 2x
    of the XLA form's error (its UT system in full float32, `Precision.HIGHEST`; H100, 2026-12-07: u 7.1e-7 against
    5.1e-7, the rest within 1.2x, with log-decays from -0.5 to -0.01; from 0 since). Exact float32 dots ("ieee") are
    not compiled here: Triton took minutes."""
    args = [jnp.asarray(x) for x in _inputs(1, 512, 48, 128, 128, seed=3)]
    want = _numpy_prep(*args, 64)
    got = jax.jit(lambda *a: _kernel_prep(*a, 64, precision=precision))(*args)
    ref = jax.jit(lambda *a: chunk_prep_jnp(*a, 64))(*args)
    for name, g, r, w in zip(("u", "w", "q_dec", "k_dec", "intra", "decay"), got, ref, want):
        err = np.abs(np.asarray(g) - w).max()
        ref_err = np.abs(np.asarray(r) - w).max()
        print(f"{precision} {name}: kernel {err:.2e}, XLA {ref_err:.2e}")
        assert err <= factor * ref_err + 1e-6, (name, err, ref_err)
