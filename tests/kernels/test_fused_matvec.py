"""The fused matvec (pallas_kernels.fused_matvec): the Pallas kernel (interpret mode on CPU, cross-lowered for CUDA,
the real thing on a GPU) against its XLA form and a float64 numpy implementation; and the model with
`enable_fused_decode` (router, shared expert, and the DeltaNet's conv + rule through the kernels) against the
transformers fixture."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
import strata_jax.loaded_model
from conftest import FIXTURES
from pallas_kernels.delta_rule import gated_delta_conv_decode
from pallas_kernels.fused_matvec import MAX_TOKENS, fused_matvec, matvec_xla, resolve_impl
from pallas_kernels.fused_router import fused_route
from strata_jax.model import deltanet, moe
from strata_jax.model.decoder import enable_fused_decode

EPS = 1e-6
VARIANTS = {  # which optional parts a case passes
    "plain": (), "gated_product": ("up",), "norm": ("norm",), "gate_residual": ("gate", "residual"),
    "all": ("up", "norm", "gate", "residual"),
}


def _inputs(t, k, n, kg, dtype, parts, seed):
    rng = np.random.default_rng(seed)
    arr = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    kwargs = {"up": arr(n, k, scale=k**-0.5), "norm": arr(k, scale=0.2), "gate": (arr(t, kg), arr(1, kg, scale=0.3)),
              "residual": arr(t, n)}
    return arr(t, k) * 3, arr(n, k, scale=k**-0.5), {p: kwargs[p] for p in parts}


def _numpy(x, w, up=None, norm=None, gate=None, residual=None, offset=1.0):
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    x = f64(x)
    if norm is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (offset + f64(norm))
    y = x @ f64(w).T
    if up is not None:
        y = y * sigmoid(y) * (x @ f64(up).T)
    if gate is not None:
        y = sigmoid(f64(gate[0]) @ f64(gate[1]).T) * y
    return y if residual is None else f64(residual) + y


def _kernel(x, w, kwargs, **options):
    f = jax.jit(lambda x, w, kw: fused_matvec(x, w, eps=EPS, impl="pallas", interpret=True, poison=True,
                                              **options, **kw))
    return f(x, w, kwargs)


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(want, np.float64),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("t,k,n", [(1, 100, 40), (3, 256, 48), (8, 70, 33), (16, 300, 16)])
def test_matches_numpy_and_xla_f32(t, k, n, variant):
    """Odd shapes (K and N not multiples of the blocks), 1-16 tokens, poisoned output: float32 within 2e-5 of
    float64 numpy and of the XLA form."""
    x, w, kwargs = _inputs(t, k, n, 50, jnp.float32, VARIANTS[variant], seed=t + k)
    got = _kernel(x, w, kwargs, step_k=64)
    assert got.shape == (t, n) and got.dtype == jnp.float32
    _close(got, _numpy(x, w, **kwargs), 2e-5)
    _close(got, matvec_xla(x, w, eps=EPS, **kwargs), 2e-5)


@pytest.mark.parametrize("variant", ["gated_product", "norm", "all"])
@pytest.mark.parametrize("t", [1, 16])
def test_matches_xla_bf16(t, variant):
    """bf16 in and out: the kernel rounds where the XLA form does, so the two agree within a bf16 step or two, and
    the kernel is no further from float64 than XLA is."""
    x, w, kwargs = _inputs(t, 256, 48, 64, jnp.bfloat16, VARIANTS[variant], seed=10 + t)
    got = _kernel(x, w, kwargs, step_k=64)
    want = matvec_xla(x, w, eps=EPS, **kwargs)
    assert got.dtype == want.dtype == jnp.bfloat16
    _close(got, want, 3e-2)
    truth = _numpy(x, w, **kwargs)
    err = lambda a: np.abs(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - truth).mean()  # noqa: E731
    assert err(got) <= 1.5 * err(want) + 1e-6


def test_plain_weight_norm_and_leading_axes():
    """offset 0 (a plain-weight RMSNorm) and [B, T, K] tokens, the gate and residual shaped alike."""
    x, w, kwargs = _inputs(6, 64, 32, 16, jnp.float32, ("norm", "gate", "residual"), seed=3)
    shaped = {"norm": kwargs["norm"], "gate": (kwargs["gate"][0].reshape(2, 3, 16), kwargs["gate"][1]),
              "residual": kwargs["residual"].reshape(2, 3, 32)}
    got = _kernel(x.reshape(2, 3, 64), w, shaped, offset=0.0, step_k=32)
    assert got.shape == (2, 3, 32)
    _close(got.reshape(6, 32), _numpy(x, w, **kwargs, offset=0.0), 2e-5)


def test_impl_choice_and_bad_shapes():
    want = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert resolve_impl("auto", 1) == want and resolve_impl("auto", MAX_TOKENS + 1) == "xla"
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("cuda", 1)
    x, w, kwargs = _inputs(17, 64, 32, 16, jnp.float32, ("up", "gate", "residual"), seed=4)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        fused_matvec(x, w, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="up is"):
        fused_matvec(x, w, up=w[:, :32])
    with pytest.raises(ValueError, match="residual is"):
        fused_matvec(x, w, residual=kwargs["residual"][:, :31])
    with pytest.raises(ValueError, match="gate is"):
        fused_matvec(x, w, gate=(kwargs["gate"][0], kwargs["gate"][1].T))
    with pytest.raises(ValueError, match="powers of two"):
        fused_matvec(x[:2], w, impl="pallas", block_n=24, interpret=True)
    # The XLA path takes any token count.
    _close(fused_matvec(x, w, **kwargs), _numpy(x, w, **kwargs), 2e-5)


@pytest.mark.parametrize("t", [1, 16])
def test_shared_expert_lowers_to_two_triton_kernels_without_a_gpu(t):
    """Interpret mode skips the Pallas -> Triton lowering; lowering for CUDA on the CPU runs it. Flash-Next's shared
    expert (bf16, H 2560, intermediate 640): the gated product, then down + gate + routed sum, two Triton kernels
    and no other op."""
    bf16 = jnp.bfloat16
    x, gate_w, up = jnp.zeros((t, 2560), bf16), jnp.zeros((640, 2560), bf16), jnp.zeros((640, 2560), bf16)
    down, shared_gate, routed = jnp.zeros((2560, 640), bf16), jnp.zeros((1, 2560), bf16), jnp.zeros((t, 2560), bf16)

    def shared_expert(x, gate_w, up, down, shared_gate, routed):
        act = fused_matvec(x, gate_w, up=up, impl="pallas")
        return fused_matvec(act, down, gate=(x, shared_gate), residual=routed, impl="pallas")

    text = jax.jit(shared_expert).trace(x, gate_w, up, down, shared_gate, routed).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert set(re.findall(r"stablehlo\.([a-z_]+)", text)) <= {"custom_call", "reshape", "return"}


def test_model_through_the_fused_kernels_matches_the_fixture(monkeypatch):
    """`enable_fused_decode` with the router, matvec and conv + delta rule kernels in interpret mode: a 7-token
    prefill chunk and token-by-token decode equal the transformers logits (float32, the parity bar); every MoE and
    DeltaNet call of at most 16 tokens ran through the kernels."""
    calls = []

    def kernel_route(x, w, k, normalize):
        calls.append(("route", x.shape[0]))
        return fused_route(x, w, k, normalize, impl="pallas", blocks=(16, 64, 32), interpret=True)

    def kernel_matvec(x, w, **kwargs):
        calls.append(("matvec", x.shape[0]))
        return fused_matvec(x, w, impl="pallas", step_k=32, interpret=True, **kwargs)

    def kernel_conv_rule(*args, **kwargs):
        calls.append(("conv_rule", args[0].shape[1]))
        return gated_delta_conv_decode(*args, impl="pallas", interpret=True, **kwargs)

    switched = []

    def fill_then_switch(model, *args, **kwargs):
        fill(model, *args, **kwargs)
        switched.append(enable_fused_decode(model))

    fill = strata_jax.loaded_model.fill_params
    monkeypatch.setattr(strata_jax.loaded_model, "fill_params", fill_then_switch)
    monkeypatch.setattr(moe, "fused_route", kernel_route)
    monkeypatch.setattr(moe, "fused_matvec", kernel_matvec)
    monkeypatch.setattr(deltanet, "gated_delta_conv_decode", kernel_conv_rule)
    path = FIXTURES / "ckpt" / "qwen4_exp_causal"
    model, ref = strata_jax.load_model(path), dict(np.load(path / "reference.npz"))
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], ids.shape[1])
    logits, _, seqs = model.step(seqs, ids[:, :7])
    parts = [logits]
    for t in range(7, 10):
        logits, _, seqs = model.step(seqs, ids[:, t : t + 1])
        parts.append(logits)
    got, want = np.concatenate(parts, axis=1), ref["logits"][:, :10]
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
    assert switched == [15]  # 8 MoE layers, the MTP layer's MoE, 6 Gated DeltaNets
    assert {kind for kind, _ in calls} == {"route", "matvec", "conv_rule"} and max(n for _, n in calls) <= MAX_TOKENS


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 16])
def test_shared_expert_on_gpu_at_flash_next_shapes(t):
    """The real kernels (bf16) against the XLA form on the GPU, each checked against float64: the kernel may differ
    from XLA by bf16 rounding, but must be no further from the truth."""
    x, w, kwargs = _inputs(t, 2560, 640, 2560, jnp.bfloat16, ("up",), seed=t)
    act = jax.jit(lambda x, w, kw: fused_matvec(x, w, impl="pallas", **kw))(x, w, kwargs)
    want = jax.jit(lambda x, w, kw: matvec_xla(x, w, **kw))(x, w, kwargs)
    _close(act, want, 5e-2)
    truth = _numpy(x, w, **kwargs)
    err = lambda a: np.abs(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - truth).mean()  # noqa: E731
    assert err(act) <= 1.5 * err(want) + 1e-6
