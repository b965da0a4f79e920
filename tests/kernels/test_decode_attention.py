"""Decode attention (pallas_kernels.decode_attention): the Pallas kernel (interpret mode on CPU, cross-lowered for
CUDA, the real thing on a GPU) and the jnp form against float64 numpy, and the model run through the kernel against
the transformers fixture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from pallas_kernels import decode_attention as da
from strata_jax.model import attention


def _numpy(q, k, v, mask):
    """float64 softmax attention: q [B, T, Hk, G, D], k, v [B, Hk, S, D], mask [B, T, S]."""
    q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v))
    scores = np.einsum("btkgd,bksd->btkgs", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[:, :, None, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("btkgs,bksd->btkgd", p / p.sum(-1, keepdims=True), v)


def _inputs(b, t, hk, g, d, s, starts, seed, dtype=jnp.float32, block=4, keep=0.6):
    """Random q, k, v; a causal mask from each slot's start, thinned by whole blocks of ``block`` positions (as the
    QSA indexer selects), the token's own position always kept; lengths = start + T."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, hk, g, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, hk, s, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, hk, s, d)), dtype)
    pos = np.asarray(starts)[:, None] + np.arange(t)
    mask = np.arange(s)[None, None, :] <= pos[..., None]
    mask &= np.repeat(rng.uniform(size=(b, t, s // block)) < keep, block, axis=-1)
    mask[np.arange(b)[:, None], np.arange(t)[None, :], pos] = True
    return q, k, v, mask, np.asarray(starts, np.int32) + t


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("b,t,hk,g,d,s,starts,block_k,splits", [
    (3, 1, 2, 3, 16, 128, [5, 60, 127], 16, 4),  # one slot at the cache's last position
    (2, 3, 1, 5, 32, 64, [0, 40], 16, 2),  # a verify window; slot 0's later splits see nothing
    (2, 5, 2, 12, 16, 256, [200, 3], 32, 8),  # Flash-Next's 12 query heads per kv head
])
def test_matches_numpy(impl, b, t, hk, g, d, s, starts, block_k, splits):
    q, k, v, mask, lengths = _inputs(b, t, hk, g, d, s, starts, seed=b + t + s)
    f = jax.jit(lambda *a: da.decode_attention(*a, impl=impl, block_k=block_k, splits=splits, interpret=True))
    got = f(q, k, v, mask, lengths)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got), _numpy(q, k, v, mask), rtol=2e-5, atol=2e-5)


def test_ignores_positions_beyond_the_length():
    """The kernel reads no block of keys past the one holding position lengths[b] - 1, and none that the mask
    skips entirely: NaN keys and values there leave the output alone. (Inside a block it reads, unselected values
    are multiplied by 0, as in the jnp form: the cache holds finite numbers.)"""
    q, k, v, mask, lengths = _inputs(2, 2, 2, 4, 16, 128, [30, 77], seed=3, keep=0.3)
    poisoned_k, poisoned_v = np.array(k), np.array(v)
    for b, n in enumerate(lengths):
        end = -(-n // 16) * 16
        poisoned_k[b, :, end:], poisoned_v[b, :, end:] = np.nan, np.nan
    skipped = ~mask.reshape(2, 2, 8, 16).any(axis=(1, 3))  # 16-key blocks no token of the slot selects
    for b, blk in zip(*np.nonzero(skipped)):
        poisoned_k[b, :, blk * 16:(blk + 1) * 16] = np.nan
    got = da.decode_attention(q, poisoned_k, poisoned_v, mask, lengths, impl="pallas", block_k=16, splits=4,
                              interpret=True)
    assert skipped.any()
    np.testing.assert_allclose(np.asarray(got), _numpy(q, k, v, mask), rtol=2e-5, atol=2e-5)


def test_bf16_within_rounding_of_float64():
    """bf16 operands (the model's): the kernel is no further from float64 than the jnp form, which rounds the
    scores and probabilities to bf16 too."""
    q, k, v, mask, lengths = _inputs(2, 2, 2, 12, 64, 256, [100, 250], seed=4, dtype=jnp.bfloat16)
    want = _numpy(q, k, v, mask)
    got = np.asarray(da.decode_attention(q, k, v, mask, lengths, impl="pallas", interpret=True), np.float32)
    ref = np.asarray(da.attention_jnp(q, k, v, mask), np.float32)
    assert np.abs(got - want).max() < 2e-2
    assert np.abs(got - want).mean() <= 1.5 * np.abs(ref - want).mean()


def test_impl_choice_and_bad_shapes():
    want = "pallas" if jax.default_backend() == "gpu" else "jnp"
    assert da.resolve_impl("auto", 1, 256, 4096) == want
    assert da.resolve_impl("auto", da.MAX_TOKENS + 1, 256, 4096) == "jnp"  # prefill chunks: the jnp form
    assert da.resolve_impl("auto", 1, 96, 4096) == "jnp"  # not a power of two
    assert da.resolve_impl("auto", 1, 256, 4000) == "jnp"  # no whole blocks of keys
    with pytest.raises(ValueError, match="impl must be"):
        da.resolve_impl("cuda", 1, 256, 4096)
    q, k, v, mask, lengths = _inputs(1, 1, 1, 2, 12, 64, [3], seed=1)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        da.decode_attention(q, k, v, mask, lengths, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="shapes do not match"):
        da.decode_attention(q, k[:, :, :32], v, mask, lengths)
    q, k, v, mask, lengths = _inputs(1, da.MAX_TOKENS + 1, 1, 2, 16, 64, [3], seed=1)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        da.decode_attention(q, k, v, mask, lengths, impl="pallas", interpret=True)
    big = jax.ShapeDtypeStruct((64, 16, 1, 2, 16), jnp.bfloat16), jax.ShapeDtypeStruct((64, 1, 2**21, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="int32"):  # 64 x 16 x 2M mask entries: past int32 offsets
        jax.eval_shape(lambda q, k: da.decode_attention(q, k, k, jnp.zeros((64, 16, 2**21), bool),
                                                        jnp.zeros((64,), jnp.int32), impl="pallas"), *big)
    assert da.default_splits(32, 2) == 8 and da.default_splits(1, 2) == 32 and da.default_splits(64, 2) == 4


@pytest.mark.parametrize("t", [1, 5])
def test_lowers_to_one_triton_kernel_without_a_gpu(t):
    """Interpret mode skips the Pallas -> Triton lowering; lowering for CUDA on the CPU runs it (Flash-Next's
    attention at 32 slots of 4096 positions: 2 kv heads of 256, 12 query heads each; decode and a verify window)."""
    bf16 = jnp.bfloat16
    args = (jnp.zeros((32, t, 2, 12, 256), bf16), jnp.zeros((32, 2, 4096, 256), bf16),
            jnp.zeros((32, 2, 4096, 256), bf16), jnp.zeros((32, t, 4096), bool), jnp.zeros((32,), jnp.int32))
    f = jax.jit(lambda *a: da.decode_attention(*a, impl="pallas"))
    assert f.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 1


def test_model_through_the_kernel_matches_the_fixture(monkeypatch):
    """The decoder with every attention call of at most 16 tokens in the kernel (interpret mode): a 7-token prefill
    chunk, then decode token by token to the 40th position, equal the transformers logits (float32, the parity
    bar). From position 12 the QSA indexer keeps 2 of the complete 4-token blocks, so the kernel skips blocks."""
    calls = []

    def kernel_attention(q, k, v, mask, lengths):
        calls.append(q.shape[1])
        return da.decode_attention(q, k, v, mask, lengths, impl="pallas", block_k=16, splits=2, interpret=True)

    monkeypatch.setattr(attention, "decode_attention", kernel_attention)
    monkeypatch.setattr(attention, "reads_filled_part", lambda: False)  # the GPU's path: off a GPU decode loops
    path = FIXTURES / "ckpt" / "qwen4_exp_causal"
    model, ref = strata_jax.load_model(path), dict(np.load(path / "reference.npz"))
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], 48)  # a whole number of 16-key blocks
    logits, _, seqs = model.step(seqs, ids[:, :7])
    parts = [logits]
    for t in range(7, ids.shape[1]):
        logits, _, seqs = model.step(seqs, ids[:, t : t + 1])
        parts.append(logits)
    got, want = np.concatenate(parts, axis=1), ref["logits"]
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
    assert set(calls) == {1, 7}


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5])
def test_kernel_on_gpu_at_flash_next_shapes(t):
    """The real kernel (bf16, 32 slots of 4096 positions, QSA-like block selection) against the jnp form on the
    GPU, each checked against float64: the kernel may differ from XLA by bf16 rounding, but must be no further from
    the truth."""
    starts = np.random.default_rng(t).integers(0, 4096 - t, size=32)
    q, k, v, mask, lengths = _inputs(32, t, 2, 12, 256, 4096, starts, seed=t, dtype=jnp.bfloat16)
    got = np.asarray(jax.jit(lambda *a: da.decode_attention(*a, impl="pallas"))(q, k, v, mask, lengths), np.float32)
    ref = np.asarray(jax.jit(da.attention_jnp)(q, k, v, mask), np.float32)
    want = _numpy(q, k, v, mask)
    np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-2)
    assert np.abs(got - want).mean() <= 1.5 * np.abs(ref - want).mean() + 1e-6
