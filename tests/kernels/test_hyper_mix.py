"""The hyper-connection mix (pallas_kernels.hyper_mix): the Pallas kernels (interpret mode on CPU, cross-lowered
for CUDA, the real thing on a GPU), the jnp form and the prefolded form (strata_jax.model.hyper.prefold_mix) against
a float64 numpy implementation, and the model run through the kernels or prefolded against the transformers
fixture."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
import strata_jax.loaded_model
from conftest import FIXTURES
from pallas_kernels import hyper_mix as hyper_mix_module
from pallas_kernels.hyper_mix import MAX_TOKENS, hyper_mix, hyper_mix_jnp, resolve_impl
from strata_jax.model import hyper

EPS = 1e-6


def _inputs(t, hc, hidden, rank, seed, combine=True, pending=False, dtype=jnp.float32):
    """streams (stream s scaled by s + 1, so that a group mix-up shows), gamma, w_down, w_up, w_inject, pending."""
    rng = np.random.default_rng(seed)
    width = hc * hidden
    streams = rng.normal(size=(t, hc, hidden)) * np.arange(1, hc + 1)[:, None]
    arrays = [streams.reshape(t, width), 0.2 * rng.normal(size=width), 2 * rng.normal(size=(rank, width)) / width**0.5,
              rng.normal(size=(width, rank)) / rank**0.5, 2 * rng.normal(size=(hc, width)) / width**0.5,
              rng.normal(size=(t, hidden)), rng.uniform(0, 2, size=(t, hc))]
    arrays = [jnp.asarray(a, dtype) for a in arrays]
    return (*arrays[:4], arrays[4] if combine else None, tuple(arrays[5:]) if pending else None)


def _numpy(streams, gamma, w_down, w_up, w_inject, pending, hc):
    """The semantics in float64: optional injection, per-stream RMSNorm, low-rank mix, mean over the streams."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x = f64(streams)
    t, width = x.shape
    hidden = width // hc
    if pending is not None:
        b, w = map(f64, pending)
        x = x + (b[:, None, :] * w[:, :, None]).reshape(t, width)
    g = x.reshape(t, hc, hidden)
    normed = (g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + EPS)).reshape(t, width) * (1 + f64(gamma))
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    down = normed @ f64(w_down).T / hc
    mix = sigmoid((down * sigmoid(down)) @ f64(w_up).T)
    mixed = np.mean((mix * normed).reshape(t, hc, hidden), axis=1)
    weights = None if w_inject is None else 2 * sigmoid(normed @ f64(w_inject).T / hc)
    return mixed, weights, x


def _run(impl, args, hc):
    *weights, pending = args
    f = jax.jit(lambda *a, p: hyper_mix(*a, hc=hc, eps=EPS, pending=p, impl=impl, interpret=True))
    return f(*weights, p=pending)


def _check(got, want, tol):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(np.asarray(jnp.asarray(g, jnp.float32)), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("pending", [False, True])
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("t", [1, 3, 16, 40])
def test_matches_numpy_f32(impl, t, combine, pending):
    args = _inputs(t, 4, 64, 32, seed=t, combine=combine, pending=pending)
    got = _run(impl, args, 4)
    _check(got, _numpy(*args, hc=4), 2e-5)
    if not pending:
        assert got[2] is not None and np.array_equal(np.asarray(got[2]), np.asarray(args[0]))


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("t,with_all", [(3, True), (40, True), (5, False)])
def test_matches_numpy_with_several_blocks(impl, t, with_all):
    """H 256 and R 48: three rank blocks of 16 in every kernel; at 40 tokens (64 rows) kernel A walks its block of
    256 columns in four steps of 64."""
    args = _inputs(t, 4, 256, 48, seed=100 + t, combine=with_all, pending=with_all)
    _check(_run(impl, args, 4), _numpy(*args, hc=4), 2e-5)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("t,with_all", [(1, True), (3, False), (40, True)])
def test_matches_numpy_bf16(impl, t, with_all):
    """bf16 in and out: both forms round after every op, so the bar is a few bf16 steps."""
    args = _inputs(t, 4, 64, 32, seed=200 + t, combine=with_all, pending=with_all, dtype=jnp.bfloat16)
    got = _run(impl, args, 4)
    assert got[0].dtype == jnp.bfloat16 and got[2].dtype == jnp.bfloat16
    _check(got, _numpy(*args, hc=4), 3e-2)


def test_kernel_keeps_leading_axes():
    """The model passes [B, T, hc*H]: the tokens are the flattened leading axes."""
    s, g, wd, wu, wi, (b, w) = _inputs(6, 4, 64, 32, seed=9, pending=True)
    shaped = (s.reshape(2, 3, -1), g, wd, wu, wi, (b.reshape(2, 3, -1), w.reshape(2, 3, -1)))
    got = _run("pallas", shaped, 4)
    assert [a.shape for a in got] == [(2, 3, 64), (2, 3, 4), (2, 3, 256)]
    _check([a.reshape(6, -1) for a in got], _numpy(s, g, wd, wu, wi, (b, w), hc=4), 2e-5)


def test_impl_choice_and_bad_shapes(monkeypatch):
    assert resolve_impl("auto", 1, 2560, 320, 4) == "jnp"  # AUTO_PALLAS is off until the kernels beat XLA
    monkeypatch.setattr(hyper_mix_module, "AUTO_PALLAS", True)
    want = "pallas" if jax.default_backend() == "gpu" else "jnp"
    assert resolve_impl("auto", 1, 2560, 320, 4) == want
    assert resolve_impl("auto", 1, 40, 32, 4) == "jnp"  # no power-of-two block of at least 16 divides H = 40
    assert resolve_impl("auto", 65, 2560, 320, 4) == "jnp"
    assert resolve_impl("auto", 1, 2560, 320, 3) == "jnp"  # kernel C has the streams as a block axis
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("cuda", 1, 64, 32, 4)
    s, g, wd, wu, wi, p = _inputs(2, 4, 40, 32, seed=1, pending=True)
    with pytest.raises(ValueError, match="power-of-two"):
        hyper_mix(s, g, wd, wu, wi, hc=4, eps=EPS, impl="pallas", interpret=True)
    s, g, wd, wu, wi, p = _inputs(65, 4, 64, 32, seed=1, pending=True)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        hyper_mix(s, g, wd, wu, wi, hc=4, eps=EPS, impl="pallas", interpret=True)
    s, g, wd, wu, wi, p = _inputs(2, 4, 64, 32, seed=1, pending=True)
    with pytest.raises(ValueError, match="w_up is"):
        hyper_mix(s, g, wd, wu.T, wi, hc=4, eps=EPS)
    with pytest.raises(ValueError, match="weights is"):
        hyper_mix(s, g, wd, wu, wi, hc=4, eps=EPS, pending=(p[0], p[1][:, :3]))
    with pytest.raises(ValueError, match="not a multiple of hc"):
        hyper_mix(s, g, wd, wu, wi, hc=3, eps=EPS)
    with pytest.raises(ValueError, match="streams dtype"):
        hyper_mix(s, g, wd, wu, wi, hc=4, eps=EPS, pending=(p[0].astype(jnp.bfloat16), p[1]), impl="pallas",
                     interpret=True)


def _real_shape_inputs(t, seed=0):
    return _inputs(t, 4, 2560, 320, seed=seed, combine=True, pending=True, dtype=jnp.bfloat16)


@pytest.mark.parametrize("t", [1, 32])
def test_lowers_to_three_triton_kernels_without_a_gpu(t):
    """Interpret mode skips the Pallas -> Triton lowering; lowering for CUDA on the CPU runs it. At the real shape
    (hc 4, H 2560, R 320, bf16), with an injection and inject weights, the whole call is three Triton kernels and
    nothing else (reshapes only)."""
    *weights, pending = _real_shape_inputs(t)
    f = jax.jit(lambda *a, p: hyper_mix(*a, hc=4, eps=EPS, pending=p, impl="pallas"))
    text = f.trace(*weights, p=pending).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    ops = set(re.findall(r"stablehlo\.([a-z_]+)", text))
    assert ops <= {"custom_call", "reshape", "return"}, ops


def _assert_fixture_logits(model, ref):
    """A 7-token prefill chunk, then 3 decode steps, equal the transformers logits (float32, the parity bar)."""
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], ids.shape[1])
    parts = []
    logits, _, seqs = model.step(seqs, ids[:, :7])
    parts.append(logits)
    for t in range(7, 10):
        logits, _, seqs = model.step(seqs, ids[:, t : t + 1])
        parts.append(logits)
    got, want = np.concatenate(parts, axis=1), ref["logits"][:, :10]
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


def test_model_through_the_kernels_matches_the_fixture(monkeypatch):
    """The decoder with every hyper-connection of at most 64 tokens in the Pallas kernels (interpret mode): a
    prefill chunk and token-by-token decode equal the transformers logits (float32, the parity bar)."""
    calls = []

    def kernel_mix(streams, *args, **kwargs):
        tokens = int(np.prod(streams.shape[:-1]))
        calls.append(tokens)
        impl = "pallas" if tokens <= MAX_TOKENS else "jnp"
        return hyper_mix(streams, *args, impl=impl, interpret=True, **kwargs)

    monkeypatch.setattr(hyper, "hyper_mix", kernel_mix)
    path = FIXTURES / "ckpt" / "qwen4_exp_causal"
    model, ref = strata_jax.load_model(path), dict(np.load(path / "reference.npz"))
    _assert_fixture_logits(model, ref)
    assert calls and max(calls) <= MAX_TOKENS


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,combine,pending", [(1, True, True), (3, False, True), (40, True, False)])
def test_prefold_matches_numpy(t, combine, pending, dtype, tol):
    *weights, p = _inputs(t, 4, 64, 32, seed=300 + t, combine=combine, pending=pending, dtype=dtype)
    s, g, wd, wu, wi = weights
    w_proj = hyper.prefolded(g, wd, wi)
    assert w_proj.shape == (32 + 4 * combine, 256) and w_proj.dtype == dtype
    got = jax.jit(lambda *a, p: hyper.prefold_mix(*a, p, hc=4, eps=EPS))(s, g, w_proj, wu, p=p)
    _check(got, _numpy(*weights, p, hc=4), tol)


def test_prefolded_model_matches_the_fixture(monkeypatch):
    """Every hyper-connection prefolded right after loading: a prefill chunk and token-by-token decode equal the
    transformers logits (float32, the parity bar); the inject projections are gone from the weights."""
    folded = []

    def fill_then_prefold(model, *args, **kwargs):
        fill(model, *args, **kwargs)
        folded.append(hyper.prefold_hyper_connections(model))

    fill = strata_jax.loaded_model.fill_params
    monkeypatch.setattr(strata_jax.loaded_model, "fill_params", fill_then_prefold)
    path = FIXTURES / "ckpt" / "qwen4_exp_causal"
    model, ref = strata_jax.load_model(path), dict(np.load(path / "reference.npz"))
    assert folded and folded[0] > 0
    names = ["/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(model.state)[0]]
    assert not any("block_inject_weight" in n for n in names)
    _assert_fixture_logits(model, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32])
def test_kernel_on_gpu_at_the_real_shape(t):
    """The real kernels (bf16, with injection and inject weights) against the jnp form on the GPU, each checked
    against float64: the kernel may differ from XLA by bf16 rounding, but must be no further from the truth."""
    *weights, pending = _real_shape_inputs(t, seed=t)
    got = jax.jit(lambda *a, p: hyper_mix(*a, hc=4, eps=EPS, pending=p, impl="pallas"))(*weights, p=pending)
    ref = jax.jit(lambda *a, p: hyper_mix_jnp(*a, hc=4, eps=EPS, pending=p))(*weights, p=pending)
    want = _numpy(*weights, pending, hc=4)
    for g, r, w in zip(got, ref, want):
        g, r = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (g, r))
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-2)
        assert np.abs(g - w).mean() <= 1.5 * np.abs(r - w).mean() + 1e-6
