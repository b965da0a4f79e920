"""The flash-style prefill attention kernel (pallas_kernels.flash_prefill, Pallas interpret mode on the CPU) against a
float64 numpy reference and the blocked jnp form (pallas_kernels.prefill_attention); the cuDNN candidate
(pallas_kernels.prefill_cudnn, through XLA's implementation off a GPU) against the same; the selector; the Triton
lowering without a GPU; and the fixture model through the kernel against the transformers logits.

Every cache position at or past a slot's ``start + n_valid`` holds NaN (for a quantized cache: NaN scales), so a
form that attends to (or multiplies by 0) anything past the filled part fails."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from pallas_kernels import flash_prefill as fp
from pallas_kernels.decode_attention import quantize_kv
from pallas_kernels.prefill_attention import prefill_attention
from pallas_kernels.prefill_cudnn import cudnn_prefill, cudnn_prefill_selected, selected_block_q
from strata_jax.model.config import PREFILL_ATTENTION_IMPLS, ConfigError, load_config


def _limits(starts, n_valid, t, s):
    n = np.full(len(starts), t) if n_valid is None else np.asarray(n_valid)
    return np.minimum(np.asarray(starts) + n, s)


def _numpy(q, k, v, starts, n_valid=None, chosen=None, c=1, tokens=None):
    """float64 attention of each token over the positions it sees: at or before its own, below start + n_valid,
    and with a QSA selection only the chosen complete blocks plus its incomplete tail block. A token that sees
    nothing gets zeros. Reads k and v only where seen. ``tokens``: only these (the others stay 0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, hk, g, d = q.shape
    s = k.shape[2]
    pos = np.asarray(starts)[:, None] + np.arange(t)
    keys = np.arange(s)
    mask = (keys[None, None, :] <= pos[..., None]) & (keys[None, None, :] < _limits(starts, n_valid, t, s)[:, None,
                                                                                                           None])
    if chosen is not None:
        in_complete = keys[None, None, :] < ((pos + 1) // c * c)[..., None]
        mask &= np.where(in_complete, np.asarray(chosen)[..., keys // c], True)
    out = np.zeros(q.shape)
    for bi in range(b):
        for ti in range(t) if tokens is None else tokens:
            seen = np.nonzero(mask[bi, ti])[0]
            if not len(seen):
                continue
            sc = np.einsum("kgd,ksd->kgs", q[bi, ti], k[bi][:, seen]) / np.sqrt(d)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[bi, ti] = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), v[bi][:, seen])
    return out


def _case(b, t, hk, g, d, s, starts, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, hk, g, d))
    k = rng.normal(size=(b, hk, s, d))
    v = rng.normal(size=(b, hk, s, d))
    return q, k, v


def _poisoned(x, limits):
    x = np.array(x)
    for bi, lim in enumerate(limits):
        x[bi, :, lim:] = np.nan
    return x


def _chosen(starts, t, s, c, top, seed):
    """Per token, `top` random complete blocks (all of them when fewer)."""
    rng = np.random.default_rng(seed)
    nb = s // c
    pos = np.asarray(starts)[:, None] + np.arange(t)
    complete = np.arange(nb)[None, None, :] < ((pos + 1) // c)[..., None]
    scores = np.where(complete, rng.random(complete.shape), -1.0)
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :top]
    chosen = np.zeros_like(complete)
    np.put_along_axis(chosen, best, True, axis=-1)
    return chosen & complete


def _kernel(q, k, v, starts, n_valid=None, chosen=None, c=1, blocks=None):
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    return fp.flash_prefill(*args, jnp.asarray(starts, jnp.int32),
                            None if n_valid is None else jnp.asarray(n_valid, jnp.int32),
                            None if chosen is None else jnp.asarray(chosen), c, blocks=blocks, interpret=True)


@pytest.mark.parametrize("b,t,hk,g,d,s,starts,n_valid,blocks", [
    # the fixtures' GQA (2 query heads per kv head), a prefix in the cache, rows of two tokens' heads per block
    (2, 37, 2, 2, 32, 256, [0, 101], None, fp.PrefillBlocks(block_m=16, block_k=32)),
    # Flash-Next's 12 query heads per kv head (a block's rows end inside a token); S not a multiple of block_k
    (1, 19, 2, 12, 16, 160, [77], None, fp.PrefillBlocks(block_m=64, block_k=64)),
    # padding tokens (they see the real ones), a slot with none (it sees nothing), odd starts, 16-key blocks
    (3, 29, 1, 3, 16, 128, [5, 60, 0], [29, 11, 0], fp.PrefillBlocks(block_m=32, block_k=16)),
])
def test_causal_matches_float64_and_the_jnp_form(b, t, hk, g, d, s, starts, n_valid, blocks):
    q, k, v = _case(b, t, hk, g, d, s, starts, seed=t + s)
    limits = _limits(starts, n_valid, t, s)
    want = _numpy(q, k, v, starts, n_valid)
    got = np.asarray(_kernel(q, _poisoned(k, limits), _poisoned(v, limits), starts, n_valid, blocks=blocks))
    jnp_form = np.asarray(prefill_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                            jnp.asarray(v, jnp.float32), jnp.asarray(starts, jnp.int32),
                                            None if n_valid is None else jnp.asarray(n_valid, jnp.int32)))
    assert got.shape == q.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, jnp_form, rtol=2e-5, atol=2e-5)
    if n_valid is not None:
        assert np.all(got[2] == 0) and np.abs(got[1, 11:]).max() > 0.1


@pytest.mark.parametrize("b,t,s,c,top,starts,blocks", [
    (1, 40, 64, 4, 2, [0], fp.PrefillBlocks(block_m=16, block_k=16)),  # the fixture's QSA: budget 8, c 4
    (2, 33, 256, 4, 5, [3, 171], fp.PrefillBlocks(block_m=32, block_k=64)),  # several QSA blocks per key block
])
def test_qsa_selection_matches_float64(b, t, s, c, top, starts, blocks):
    q, k, v = _case(b, t, 2, 2, 16, s, starts, seed=s + t)
    chosen = _chosen(starts, t, s, c, top, seed=t)
    limits = _limits(starts, None, t, s)
    want = _numpy(q, k, v, starts, None, chosen, c)
    assert not np.allclose(want, _numpy(q, k, v, starts))  # the selection matters
    got = np.asarray(_kernel(q, _poisoned(k, limits), _poisoned(v, limits), starts, None, chosen, c, blocks=blocks))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_quantized_cache_matches_the_jnp_form():
    """int8 keys and values with per-position scales (NaN scales past the filled part) as the jnp form reads them."""
    b, t, s, starts = 2, 24, 128, [9, 70]
    q, k, v = _case(b, t, 2, 3, 16, s, starts, seed=3)
    (k8, ks), (v8, vs) = quantize_kv(jnp.asarray(k), jnp.int8), quantize_kv(jnp.asarray(v), jnp.int8)
    limits = _limits(starts, None, t, s)
    q32, st = jnp.asarray(q, jnp.float32), jnp.asarray(starts, jnp.int32)
    want = np.asarray(prefill_attention(q32, k8, v8, st, k_scale=ks, v_scale=vs))
    ks_p = jnp.asarray(_poisoned(np.asarray(ks)[..., None], limits)[..., 0])
    vs_p = jnp.asarray(_poisoned(np.asarray(vs)[..., None], limits)[..., 0])
    got = np.asarray(fp.flash_prefill(q32, k8, v8, st, k_scale=ks_p, v_scale=vs_p, interpret=True,
                                      blocks=fp.PrefillBlocks(block_m=32, block_k=32)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_bf16_within_rounding_of_float64():
    """bf16 operands at Flash-Next's 12 query heads per kv head: no further from float64 than the jnp form."""
    b, t, s, starts = 1, 24, 128, [50]
    q, k, v = _case(b, t, 2, 12, 32, s, starts, seed=7)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    want = _numpy(*(np.asarray(x, np.float64) for x in bf), starts)
    got = fp.flash_prefill(*bf, jnp.asarray(starts, jnp.int32), interpret=True)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    ref = np.asarray(prefill_attention(*bf, jnp.asarray(starts, jnp.int32)), np.float32)
    assert np.abs(got - want).max() < 2e-2
    assert np.abs(got - want).mean() <= 1.5 * np.abs(ref - want).mean()


def test_cudnn_form_matches_float64():
    """The two calls (prefix, then the chunk's own keys causally) merged by log-sum-exp, through XLA's
    implementation on the CPU: a prefix of 0 (its part empty), padding tokens, a slot with no real token."""
    b, t, hk, g, d, s = 4, 21, 2, 3, 16, 96
    starts, n_valid = [0, 40, 30, 0], [21, 9, 0, 0]
    q, k, v = _case(b, t, hk, g, d, s, starts, seed=11)
    rows = np.arange(b)[:, None], np.asarray(starts)[:, None] + np.arange(t)
    k_new = np.transpose(k, (0, 2, 1, 3))[rows]  # [B, T, Hk, D]: the chunk's keys as written at start on
    v_new = np.transpose(v, (0, 2, 1, 3))[rows]
    # XLA's implementation scores every cache position (0 x NaN would show), so the cache past the prefix holds
    # random numbers here: the chunk's part must come from k_new, v_new (the cache's copy differs below).
    k_cache, v_cache = (np.array(x) for x in (k, v))
    for bi, st in enumerate(starts):
        k_cache[bi, :, st:] += 1.0
        v_cache[bi, :, st:] -= 1.0
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k_cache, v_cache)]
    got = np.asarray(cudnn_prefill(*f32, jnp.asarray(starts), jnp.asarray(n_valid), jnp.asarray(k_new, jnp.float32),
                                   jnp.asarray(v_new, jnp.float32)))
    want = _numpy(q, k, v, starts, n_valid)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.all(got[3] == 0) and np.abs(got[2]).max() > 0.1  # nothing seen; the prefix alone


@pytest.mark.parametrize("block_q", [8, 64])
def test_cudnn_selected_form_matches_float64(block_q):
    """A QSA selection as the attention mask, in query blocks (8: three blocks, the last partial) or one call,
    through XLA's implementation on the CPU: an empty prefix, padding tokens, slots with no real token (one with a
    prefix, one without). XLA's
    implementation scores every cache position, so past the filled part the cache holds finite garbage (NaN would
    reach the output through 0 x NaN): a form reading past the mask or the limit would differ from float64."""
    b, t, hk, g, d, s, c = 4, 21, 2, 3, 16, 128, 4
    starts, n_valid = [0, 40, 17, 0], [21, 9, 0, 0]
    q, k, v = _case(b, t, hk, g, d, s, starts, seed=31)
    chosen = _chosen(starts, t, s, c, 3, seed=32)
    want = _numpy(q, k, v, starts, n_valid, chosen, c)
    assert not np.allclose(want, _numpy(q, k, v, starts, n_valid))  # the selection matters
    limits = _limits(starts, n_valid, t, s)
    k_cache, v_cache = (np.array(x) for x in (k, v))
    for bi, lim in enumerate(limits):
        k_cache[bi, :, lim:] += 3.0
        v_cache[bi, :, lim:] -= 3.0
    got = np.asarray(cudnn_prefill_selected(jnp.asarray(q, jnp.float32), jnp.asarray(k_cache, jnp.float32),
                                            jnp.asarray(v_cache, jnp.float32), jnp.asarray(starts),
                                            jnp.asarray(n_valid), jnp.asarray(chosen), c, block_q=block_q))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.all(got[3] == 0)  # nothing seen
    assert np.abs(got[1, 9:]).max() > 0.1 and np.abs(got[2]).max() > 0.1  # padding sees the real ones, the prefix


def test_selected_block_q_bounds_the_mask():
    assert selected_block_q(1, 65536) == 1024  # 192 MiB of mask
    assert selected_block_q(4, 65536) == 256
    assert selected_block_q(4, 262144) == 128  # the floor: more calls would cost more than the mask saves
    for b, s in [(1, 4096), (2, 65536), (8, 31744)]:
        block = selected_block_q(b, s)
        assert block & (block - 1) == 0 and (b * block * s * 3 <= 256 * 2**20 or block == 128)


class _Device:
    def __init__(self, capability: str):
        self.compute_capability = capability


@pytest.mark.parametrize("capability, dtype, selected, quantized, want", [
    ("9.0", jnp.bfloat16, False, False, "cudnn"),  # Hopper, where cuDNN measured 3.7-4.2x the jnp form
    ("9.0", jnp.float16, False, False, "cudnn"),
    ("9.0", jnp.float32, False, False, "jnp"),  # cuDNN's fused attention wants 16-bit operands
    ("9.0", jnp.bfloat16, True, False, "cudnn"),  # a QSA selection as cuDNN's mask: 1.33-1.54x the jnp form
    ("9.0", jnp.bfloat16, True, True, "jnp"),
    ("9.0", jnp.bfloat16, False, True, "jnp"),  # int8 / fp8 cache
    ("8.6", jnp.bfloat16, False, False, "jnp"),  # not measured there
    ("12.0", jnp.bfloat16, False, False, "jnp"),
])
def test_auto_takes_cudnn_on_hopper(monkeypatch, capability, dtype, selected, quantized, want):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(capability)])
    monkeypatch.setattr(fp, "AUTO_SELECTED", False)  # QSA chunks to cuDNN, not the selected-keys kernel
    assert fp.resolve_prefill_impl("auto", 256, 4096, selected, quantized, dtype) == want
    assert fp.resolve_prefill_impl("auto", 256, 4096, False, False, None) == "jnp"  # dtype unknown
    monkeypatch.setattr(fp, "AUTO_CUDNN_SELECTED", False)  # the switch back: plain chunks only
    assert fp.resolve_prefill_impl("auto", 256, 4096, selected, quantized, dtype) == ("jnp" if selected else want)


def test_selector():
    assert fp.PREFILL_IMPLS == PREFILL_ATTENTION_IMPLS
    assert fp.resolve_prefill_impl("auto", 256, 4096, False, False, jnp.bfloat16) == "jnp"  # no GPU here
    assert fp.resolve_prefill_impl("auto", 256, 4096, True, False, jnp.bfloat16, group=12, compress_ratio=4) == "jnp"
    assert fp.resolve_prefill_impl("pallas", 256, 4096, True, True) == "pallas"
    assert fp.resolve_prefill_impl("pallas", 96, 4096, False, False) == "jnp"  # not a power-of-two head dim
    assert fp.resolve_prefill_impl("pallas", 256, 32, False, False) == "jnp"  # a cache shorter than a key block
    assert fp.resolve_prefill_impl("cudnn", 256, 4096, False, False) == "cudnn"
    assert fp.resolve_prefill_impl("cudnn", 256, 4096, True, False) == "cudnn"  # the selection as its mask
    assert fp.resolve_prefill_impl("cudnn", 256, 4096, False, True) == "jnp"  # int8 / fp8 cache
    with pytest.raises(ValueError, match="must be one of"):
        fp.resolve_prefill_impl("flash", 256, 4096, False, False)
    with pytest.raises(ValueError, match="needs the chunk's own keys"):
        q, k, v = _case(1, 20, 1, 2, 16, 64, [0], seed=0)
        fp.attend_prefill(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.zeros((1,), jnp.int32), impl="cudnn")
    with pytest.raises(ValueError, match="power-of-two head dim"):
        q, k, v = _case(1, 20, 1, 2, 24, 64, [0], seed=0)
        fp.flash_prefill(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.zeros((1,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        fp.PrefillBlocks(block_m=48)
    with pytest.raises(ConfigError, match="prefill_attention_impl"):
        import dataclasses
        dataclasses.replace(load_config(FIXTURES / "ckpt" / "qwen3_next"), prefill_attention_impl="flash")


@pytest.mark.parametrize("variant", ["causal", "qsa", "int8"])
def test_lowers_to_one_triton_kernel_without_a_gpu(variant):
    """Flash-Next's shapes (bf16, 12 query heads per kv head, head dim 256) through the Pallas -> Triton lowering,
    which interpret mode skips: it rejects what Triton cannot express."""
    b, t, hk, g, d, s = 1, 100, 2, 12, 256, 1024
    sd = jax.ShapeDtypeStruct
    kv = jnp.int8 if variant == "int8" else jnp.bfloat16
    args = [sd((b, t, hk, g, d), jnp.bfloat16), sd((b, hk, s, d), kv), sd((b, hk, s, d), kv), sd((b,), jnp.int32),
            sd((b, t, s // 4), jnp.bool_) if variant == "qsa" else None]
    scales = [sd((b, hk, s), jnp.float32)] * 2 if variant == "int8" else [None, None]
    f = jax.jit(lambda q, k, v, st, ch, ks, vs: fp.flash_prefill(q, k, v, st, None, ch, 4, k_scale=ks, v_scale=vs))
    text = f.trace(*args, *scales).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def _model_through(impl, monkeypatch, name="qwen4_exp_causal"):
    """The fixture's logits from two 20-token prefill chunks (past the decode kernel's 16), the attention layers'
    prefill through ``impl``; returns (logits, want, calls of the kernel or cuDNN form)."""
    calls = []
    for fn in ("flash_prefill", "cudnn_prefill", "cudnn_prefill_selected"):
        real = getattr(fp, fn)
        monkeypatch.setattr(fp, fn, lambda *a, _real=real, _fn=fn, **kw: calls.append(_fn) or _real(*a, **kw))
    path = FIXTURES / "ckpt" / name
    model, ref = strata_jax.load_model(path, prefill_attention=impl), dict(np.load(path / "reference.npz"))
    assert model.config.prefill_attention_impl == impl
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], 64)  # a whole key block of the fixture's head dim
    first, _, seqs = model.step(seqs, ids[:, :20])
    second, _, seqs = model.step(seqs, ids[:, 20:40])
    return np.concatenate([first, second], axis=1), ref["logits"], calls


def test_model_through_the_kernel_matches_transformers(monkeypatch):
    """qwen4_exp with its QSA indexer (budget 8 tokens: a real selection at a 64-position cache)."""
    got, want, calls = _model_through("pallas", monkeypatch)
    assert calls and set(calls) == {"flash_prefill"}
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


def test_model_through_cudnn_matches_transformers(monkeypatch):
    """qwen3_next (plain causal attention: the cuDNN form applies; XLA's implementation on the CPU)."""
    got, want, calls = _model_through("cudnn", monkeypatch, "qwen3_next")
    assert calls and set(calls) == {"cudnn_prefill"}
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


def test_model_through_cudnn_with_selection_matches_transformers(monkeypatch):
    """qwen4_exp with its QSA indexer (budget 8 tokens at a 64-position cache): the selection as cuDNN's mask."""
    got, want, calls = _model_through("cudnn", monkeypatch)
    assert calls and set(calls) == {"cudnn_prefill_selected"}
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


@pytest.mark.gpu
@pytest.mark.parametrize("qsa", [False, True])
def test_kernel_on_gpu_at_flash_next_shapes(qsa):
    """The compiled kernel (bf16, Flash-Next heads, a 4,000-token prefix, a 1,000-token chunk) against the jnp form
    and float64 (on a sample of tokens): no further from float64 than the jnp form."""
    b, t, hk, g, d, s, starts = 1, 1000, 2, 12, 256, 8192, [4000]
    q, k, v = _case(b, t, hk, g, d, s, starts, seed=21)
    chosen = _chosen(starts, t, s, 4, 512, seed=22) if qsa else None
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    args = (*bf, jnp.asarray(starts, jnp.int32), None, None if chosen is None else jnp.asarray(chosen), 4)
    got = np.asarray(jax.jit(fp.flash_prefill, static_argnums=6)(*args), np.float32)
    ref = np.asarray(jax.jit(prefill_attention, static_argnums=6)(*args), np.float32)
    sample = np.arange(0, t, 97)
    want = _numpy(*(np.asarray(x, np.float64) for x in bf), starts, None, chosen, 4, tokens=sample)[:, sample]
    assert np.abs(got[:, sample] - want).mean() <= 1.5 * np.abs(ref[:, sample] - want).mean() + 1e-6
    np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_cudnn_on_gpu_at_flash_next_shapes():
    """cuDNN's fused attention (bf16, Flash-Next heads) merged over prefix and chunk, against the jnp form."""
    b, t, hk, g, d, s, starts = 1, 1024, 2, 12, 256, 8192, [3000]
    q, k, v = _case(b, t, hk, g, d, s, starts, seed=23)
    rows = np.arange(b)[:, None], np.asarray(starts)[:, None] + np.arange(t)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    k_new, v_new = (jnp.transpose(x, (0, 2, 1, 3))[rows] for x in bf[1:])
    st = jnp.asarray(starts, jnp.int32)
    got = np.asarray(jax.jit(cudnn_prefill)(*bf, st, None, k_new, v_new), np.float32)
    ref = np.asarray(jax.jit(prefill_attention)(*bf, st), np.float32)
    np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_cudnn_selected_on_gpu_at_flash_next_shapes():
    """cuDNN's fused attention with a QSA selection as its mask (bf16, Flash-Next heads, a 1,500-token chunk after
    3,000 cached tokens in query blocks of 1,024 and a partial one, padding after 1,400 tokens) against the jnp form
    and float64 on a sample of tokens: no further from float64 than the jnp form."""
    b, t, hk, g, d, s, starts, n_valid = 1, 1500, 2, 12, 256, 8192, [3000], [1400]
    q, k, v = _case(b, t, hk, g, d, s, starts, seed=24)
    chosen = _chosen(starts, t, s, 4, 512, seed=25)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    st, n, ch = jnp.asarray(starts, jnp.int32), jnp.asarray(n_valid, jnp.int32), jnp.asarray(chosen)
    got = np.asarray(jax.jit(cudnn_prefill_selected, static_argnums=6)(*bf, st, n, ch, 4), np.float32)
    ref = np.asarray(jax.jit(prefill_attention, static_argnums=6)(*bf, st, n, ch, 4), np.float32)
    sample = np.arange(0, 1400, 97)
    want = _numpy(*(np.asarray(x, np.float64) for x in bf), starts, n_valid, chosen, 4, tokens=sample)[:, sample]
    assert np.abs(got[:, sample] - want).mean() <= 1.5 * np.abs(ref[:, sample] - want).mean() + 1e-6
    np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-2)
