"""The fused MoE router (pallas_kernels.fused_router): the two Pallas kernels (interpret mode on CPU, cross-lowered
for CUDA, the real thing on a GPU) against the model's XLA router and a float64 numpy top-k."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fused_router import MAX_TOKENS, fused_route, resolve_impl, route_xla
from strata_jax.model.moe import route


def _kernel(x, w, k, normalize, blocks=None):
    f = jax.jit(lambda x, w: fused_route(x, w, k, normalize, impl="pallas", blocks=blocks, interpret=True,
                                         poison=True))
    return f(x, w)


def _integer_inputs(t, e, h, dtype, seed):
    """Small integers: every product and sum is exact in float32 whatever the order, so the logits equal XLA's bit
    for bit, and they tie often (the lower expert must win, as in lax.top_k)."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(-3, 4, size=(t, h)), dtype), jnp.asarray(rng.integers(-3, 4, size=(e, h)), dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,e,h,k,normalize", [(1, 512, 256, 10, True), (3, 48, 100, 10, False),
                                               (8, 64, 700, 4, True), (16, 40, 33, 1, False)])
def test_identical_to_xla_on_exact_inputs(t, e, h, k, normalize, dtype):
    """Odd shapes (E and H not multiples of the blocks, E not a power of two), 1-16 tokens, poisoned outputs: the
    ids equal the XLA router's, ties included, and so do the weights (up to the softmax sum's rounding)."""
    x, w = _integer_inputs(t, e, h, dtype, seed=t * 7 + e)
    ids, weights = _kernel(x, w, k, normalize, blocks=(32, 256, 64) if e > 64 else (16, 64, 32))
    want_ids, want_weights = route_xla(x, w, k, normalize)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32 and ids.shape == (t, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-30)


def test_ties_go_to_the_lower_expert():
    """Every logit equal: the first k experts, each with weight 1/k."""
    x, w = jnp.ones((3, 64), jnp.float32), jnp.ones((96, 64), jnp.float32)
    ids, weights = _kernel(x, w, 10, True)
    np.testing.assert_array_equal(np.asarray(ids), np.tile(np.arange(10), (3, 1)))
    np.testing.assert_allclose(np.asarray(weights), 0.1, rtol=1e-6)


@pytest.mark.parametrize("t", [1, 16])
def test_matches_numpy_and_the_model_route_at_real_width(t):
    """Random float32 weights at Flash-Next's router shape (512 x 2560, top-10, normalised): the ids equal a float64
    numpy top-k and the model's `route`, the weights the numpy softmax."""
    rng = np.random.default_rng(t)
    x = rng.normal(size=(t, 2560)).astype(np.float32)
    w = (rng.normal(size=(512, 2560)) / 50).astype(np.float32)
    ids, weights = _kernel(jnp.asarray(x), jnp.asarray(w), 10, True)
    logits = x.astype(np.float64) @ w.T.astype(np.float64)
    want_ids = np.argsort(-logits, axis=1, kind="stable")[:, :10]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want = np.take_along_axis(probs, want_ids, 1)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want / want.sum(1, keepdims=True), rtol=2e-5)
    model_ids, _ = route(jnp.einsum("nh,eh->ne", jnp.asarray(x), jnp.asarray(w)), 10, True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(model_ids))


def test_impl_choice_and_bad_input():
    want = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert resolve_impl("auto", 1) == want and resolve_impl("auto", MAX_TOKENS) == want
    assert resolve_impl("auto", MAX_TOKENS + 1) == "xla"
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("triton", 1)
    x, w = _integer_inputs(17, 32, 64, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        fused_route(x, w, 4, True, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="does not fit"):
        fused_route(x[:2, :63], w, 4, True)
    with pytest.raises(ValueError, match="top_k must be"):
        fused_route(x[:2], w, 33, True)
    with pytest.raises(ValueError, match="powers of two"):
        fused_route(x[:2], w, 4, True, impl="pallas", blocks=(16, 64, 48), interpret=True)
    # The XLA path takes any token count (a prefill chunk), leading axes flattened.
    ids, _ = fused_route(x.reshape(1, 17, 64), w, 4, True, impl="auto")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(route_xla(x, w, 4, True)[0]))


@pytest.mark.parametrize("t", [1, 16])
def test_lowers_to_two_triton_kernels_without_a_gpu(t):
    """Interpret mode skips the Pallas -> Triton lowering; lowering for CUDA on the CPU runs it. At Flash-Next's
    shape (bf16, 512 experts, H 2560, top-10) the router is two Triton kernels and no other op."""
    x, w = jnp.zeros((t, 2560), jnp.bfloat16), jnp.zeros((512, 2560), jnp.bfloat16)
    f = jax.jit(lambda x, w: fused_route(x, w, 10, True, impl="pallas"))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert set(re.findall(r"stablehlo\.([a-z_]+)", text)) <= {"custom_call", "reshape", "return"}


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 16])
def test_kernels_on_gpu_at_flash_next_shapes(t):
    """The real kernels (bf16 weights) on the GPU against float64 numpy: logits summed exactly and rounded once to
    bf16 (what the model's bf16 matmul means), then softmax, top-k and normalisation. Not against XLA's router on
    the GPU: its bf16 GEMM rounds differently (on the H200, 2026-12-02, logits one bf16 step apart swapped 4 of 10
    experts of a token and moved the weights by up to 1%). Rows with one of their 11 best logits within 1e-6 of a
    bf16 rounding boundary are left out (the kernel's float32 sum, good to ~1e-7 here, may round it either way)."""
    import ml_dtypes

    rng = np.random.default_rng(t)
    x = rng.normal(size=(t, 2560)).astype(ml_dtypes.bfloat16)
    w = (rng.normal(size=(512, 2560)) / 50).astype(ml_dtypes.bfloat16)
    ids, weights = jax.jit(lambda x, w: fused_route(x, w, 10, True, impl="pallas"))(jnp.asarray(x), jnp.asarray(w))
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    logits = exact.astype(ml_dtypes.bfloat16).astype(np.float64)
    near = (exact + 1e-6).astype(ml_dtypes.bfloat16) != (exact - 1e-6).astype(ml_dtypes.bfloat16)
    near = np.take_along_axis(near, np.argsort(-exact, axis=1)[:, :11], 1)  # the normalised top-10 needs no others
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :10]
    want = np.take_along_axis(probs, want_ids, 1)
    keep = ~near.any(1)
    assert keep.sum() >= t - 1, "too many logits on a rounding boundary for this seed"
    np.testing.assert_array_equal(np.asarray(ids)[keep], want_ids[keep])
    np.testing.assert_allclose(np.asarray(weights)[keep], (want / want.sum(1, keepdims=True))[keep], rtol=2e-5)


def test_load_model_switches_the_fused_kernels_on():
    """`load_model(fused_decode=True)` (what `serve --fused-decode` passes) switches every MoE and DeltaNet module;
    off a GPU they run the XLA path, so the fixture's reference logits still hold."""
    from flax import nnx

    import strata_jax
    from conftest import FIXTURES
    from strata_jax.model.deltanet import GatedDeltaNet
    from strata_jax.model.moe import SparseMoe

    path = FIXTURES / "ckpt" / "qwen3_next"
    model = strata_jax.load_model(path, fused_decode=True)
    def switched(loaded) -> list[bool]:
        graph = nnx.merge(loaded._graphdef, loaded._state)
        return [m.fused_decode for _, m in nnx.iter_graph(graph) if isinstance(m, (SparseMoe, GatedDeltaNet))]

    assert switched(model) and all(switched(model))
    assert not any(switched(strata_jax.load_model(path)))
    ref = dict(np.load(path / "reference.npz"))
    got = np.asarray(model.logits(ref["input_ids"]))
    assert np.abs(got - ref["logits"]).max() <= 1e-4 * np.abs(ref["logits"]).max()
