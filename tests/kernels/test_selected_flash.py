"""The selected-keys QSA prefill kernel (pallas_kernels.selected_flash, Pallas interpret mode on the CPU) against the
dense masked form built from the same selection and against float64; every cache position no token sees holds NaN,
so a kernel that lets an unseen key or value into a result fails. Also: which form the selector picks, the Triton
lowering at Flash-Next shapes without a GPU, the fixture model through the kernel against the transformers logits,
and (on a GPU) the compiled kernel at Flash-Next shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from pallas_kernels import flash_prefill as fp
from pallas_kernels.selected_attention import selected_attention
from pallas_kernels.selected_flash import ROWS, SelectedBlocks, kernel_supports, selected_flash
from strata_jax.model import attention
from test_selected_attention import _case, _want, check_sees_exactly_its_blocks_and_tail


def _poison_unseen(k, v, mask):
    """k, v [B, Hk, S, D] with NaN at every position no token of the slot sees (mask [B, T, S])."""
    unseen = ~np.asarray(mask).any(axis=1)  # [B, S]
    k, v = np.array(k), np.array(v)
    k[unseen[:, None, :, None].repeat(k.shape[1], 1).repeat(k.shape[3], 3)] = np.nan
    v[unseen[:, None, :, None].repeat(v.shape[1], 1).repeat(v.shape[3], 3)] = np.nan
    return jnp.asarray(k), jnp.asarray(v)


def _run(q, k, v, starts, ids, c, n_valid=None, blocks=SelectedBlocks(block_k=16)):
    nv = None if n_valid is None else jnp.asarray(n_valid, jnp.int32)
    return np.asarray(selected_flash(q, k, v, jnp.asarray(starts, jnp.int32), ids, c, nv, blocks=blocks,
                                     interpret=True))


@pytest.mark.parametrize("b,t,hk,g,d,s,c,top,starts,n_valid,block_k", [
    (2, 9, 2, 3, 16, 256, 4, 5, [0, 120], None, 16),  # slot 0: no complete block, then fewer than `top`
    (3, 33, 1, 2, 16, 512, 4, 8, [7, 200, 470], [33, 20, 33], 16),  # padding tokens; slot 2 at the cache's end
    (1, 16, 2, 2, 16, 96, 4, 4, [80], [16], 16),  # the chunk ends at the cache's last position: tail id = S / c
    (1, 11, 2, 12, 16, 256, 4, 9, [150], None, 32),  # Flash-Next's 12 heads per kv head; 8 blocks per step
    (2, 7, 1, 5, 16, 128, 8, 3, [60, 9], [7, 0], 16),  # blocks of 8 keys; a slot with no real token
])
def test_equals_the_dense_masked_form(b, t, hk, g, d, s, c, top, starts, n_valid, block_k):
    q, k, v, ids = _case(b, t, hk, g, d, s, c, top, starts, seed=t + g)
    want, mask = _want(q, k, v, starts, ids, c, n_valid)
    kp, vp = _poison_unseen(k, v, mask)
    got = _run(q, kp, vp, starts, ids, c, n_valid, SelectedBlocks(block_k=block_k))
    real = np.arange(t)[None, :] < (np.full(b, t) if n_valid is None else np.asarray(n_valid))[:, None]
    seen = mask.any(-1) & real  # a token that sees nothing is 0 here, NaN in the dense form
    np.testing.assert_allclose(got[seen], want[seen], rtol=2e-5, atol=2e-6)
    assert (got[~seen] == 0).all()  # padding tokens too: the kernel skips them


def test_equals_the_jnp_gather_form_it_replaces():
    """The same arguments as `selected_attention` (the form off a GPU): the same result for real tokens."""
    q, k, v, ids = _case(2, 13, 2, 4, 16, 256, 4, 6, [30, 190], seed=4)
    st, nv = jnp.asarray([30, 190], jnp.int32), jnp.asarray([13, 9], jnp.int32)
    want = np.asarray(selected_attention(q, k, v, st, ids, 4, nv))
    got = _run(q, k, v, [30, 190], ids, 4, [13, 9])
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got[1, :9], want[1, :9], rtol=2e-5, atol=2e-6)


def test_a_token_sees_exactly_its_blocks_and_tail():
    check_sees_exactly_its_blocks_and_tail(
        lambda q, k, v, st, ids, c: selected_flash(q, k, v, st, ids, c, blocks=SelectedBlocks(block_k=16),
                                                   interpret=True))


def test_bf16_within_rounding_of_float64():
    """bf16 operands: no further from float64 than the jnp gather form with the same operands."""
    q, k, v, ids = _case(1, 24, 2, 12, 64, 512, 4, 40, [300], seed=7, dtype=jnp.bfloat16)
    st = jnp.asarray([300], jnp.int32)
    want, _ = _want(*(x.astype(jnp.float32) for x in (q, k, v)), [300], ids, 4)
    got = _run(q, k, v, [300], ids, 4).astype(np.float32)
    ref = np.asarray(selected_attention(q, k, v, st, ids, 4), np.float32)
    assert np.abs(got - want).mean() <= 1.5 * np.abs(ref - want).mean() + 1e-6


def test_gradient_is_the_references_for_real_tokens():
    """The demo trainer differentiates the attention layer: the kernel's gradient is the jnp gather form's, with
    nothing from the rows it zeroes (tokens past n_valid)."""
    b, t, hk, g, d, s, c, top = 2, 7, 1, 2, 16, 128, 4, 4
    q, k, v, ids = _case(b, t, hk, g, d, s, c, top, [50, 20], seed=9)
    st, nv = jnp.asarray([50, 20], jnp.int32), jnp.asarray([7, 5], jnp.int32)
    real = (jnp.arange(t)[None, :] < nv[:, None])[:, :, None, None, None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(fn(q, k, v)), 0.0))

    kernel = lambda q, k, v: selected_flash(q, k, v, st, ids, c, nv, blocks=SelectedBlocks(block_k=16),  # noqa: E731
                                            interpret=True)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: selected_attention(q, k, v, st, ids, c, nv)), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(got[0])).sum() > 0


def test_supported_shapes_and_bad_arguments():
    assert kernel_supports(256, 12, 4) and kernel_supports(16, ROWS, 32)
    assert not kernel_supports(96, 12, 4)  # head dim not a power of two
    assert not kernel_supports(256, ROWS + 1, 4)  # more query heads per kv head than a program's rows
    assert not kernel_supports(256, 12, 6) and not kernel_supports(256, 12, 128)  # blocks that do not tile a step
    assert not kernel_supports(256, 12, 4, cache_elements=16 * 2 * 262144 * 256)  # past int32 offsets
    q, k, v, ids = _case(1, 4, 1, 2, 16, 64, 4, 3, [10], seed=0)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        _run(q[..., :12], k[..., :12], v[..., :12], [10], ids, 4)
    with pytest.raises(ValueError, match="shapes do not match"):
        _run(q, k[:, :, :32], v, [10], ids, 4)
    with pytest.raises(ValueError, match="ids must be"):
        _run(q, k, v, [10], ids[:, :2], 4)
    with pytest.raises(ValueError, match="float caches"):
        _run(q, k.astype(jnp.int8), v.astype(jnp.int8), [10], ids, 4)
    with pytest.raises(ValueError, match="power of two"):
        SelectedBlocks(block_k=48)


def test_selector(monkeypatch):
    """"selected" takes chunks with a selection where the kernel applies, plain chunks as "auto"; "auto" takes it
    on a GPU while `AUTO_SELECTED`."""
    r = fp.resolve_prefill_impl
    assert r("selected", 256, 4096, True, False, jnp.bfloat16, group=12, compress_ratio=4) == "selected"
    assert r("selected", 256, 4096, True, True, jnp.bfloat16, group=12, compress_ratio=4) == "jnp"  # int8 cache
    assert r("selected", 256, 4096, True, False, jnp.bfloat16, group=24, compress_ratio=4) == "jnp"
    assert r("selected", 256, 4096, False, False, jnp.bfloat16, group=12, compress_ratio=4) == "jnp"  # as auto here
    # 16 slots of a 262,144-token cache: past the kernel's int32 offsets, so the masked form
    assert r("selected", 256, 262144, True, False, jnp.bfloat16, group=12, compress_ratio=4,
             cache_elements=16 * 2 * 262144 * 256) == "jnp"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [type("D", (), {"compute_capability": "9.0"})()])
    assert r("selected", 256, 4096, False, False, jnp.bfloat16, group=12, compress_ratio=4) == "cudnn"
    for switch, want in ((True, "selected"), (False, "cudnn")):
        monkeypatch.setattr(fp, "AUTO_SELECTED", switch)
        assert r("auto", 256, 4096, True, False, jnp.bfloat16, group=12, compress_ratio=4) == want
        assert r("auto", 256, 4096, False, False, jnp.bfloat16, group=12, compress_ratio=4) == "cudnn"
        assert r("auto", 256, 262144, True, False, jnp.bfloat16, group=12, compress_ratio=4,
                 cache_elements=2**31) == "cudnn"  # too large a cache for the kernel: the mask again
        assert r("auto", 256, 4096, True, False, jnp.float32, group=12, compress_ratio=4) == "jnp"  # not measured


def test_lowers_to_one_triton_kernel_without_a_gpu():
    """Flash-Next's shapes (bf16, 12 query heads per kv head, head dim 256, 512 blocks of 4 per token) through the
    Pallas -> Triton lowering, which interpret mode skips."""
    b, t, hk, g, d, s, top = 1, 100, 2, 12, 256, 4096, 512
    sd = jax.ShapeDtypeStruct
    args = [sd((b, t, hk, g, d), jnp.bfloat16), sd((b, hk, s, d), jnp.bfloat16), sd((b, hk, s, d), jnp.bfloat16),
            sd((b,), jnp.int32), sd((b, t, top), jnp.int32), sd((b,), jnp.int32)]
    f = jax.jit(lambda q, k, v, st, ids, nv: selected_flash(q, k, v, st, ids, 4, nv))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_model_through_the_kernel_matches_transformers(monkeypatch):
    """qwen4_exp with its QSA indexer (budget 8 tokens: a real selection at a 64-position cache), two 20-token
    prefill chunks through the kernel."""
    calls = []
    real = attention.selected_flash
    monkeypatch.setattr(attention, "selected_flash", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    path = FIXTURES / "ckpt" / "qwen4_exp_causal"
    model, ref = strata_jax.load_model(path, prefill_attention="selected"), dict(np.load(path / "reference.npz"))
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], 64)
    first, _, seqs = model.step(seqs, ids[:, :20])
    second, _, seqs = model.step(seqs, ids[:, 20:40])
    got, want = np.concatenate([first, second], axis=1), ref["logits"]
    assert calls
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


@pytest.mark.gpu
@pytest.mark.parametrize("block_k,num_warps", [(64, 4), (32, 4), (64, 8)])
def test_kernel_on_gpu_at_flash_next_shapes(block_k, num_warps):
    """The compiled kernel (bf16, Flash-Next heads, 512 blocks of 4 per token, a 1,000-token chunk after 6,000
    cached tokens, padding after 900) against the jnp gather form: the same within bf16 rounding, and no further
    from float64 on a sample of tokens."""
    b, t, hk, g, d, s, c, top, starts, n_valid = 1, 1000, 2, 12, 256, 8192, 4, 512, [6000], [900]
    q, k, v, ids = _case(b, t, hk, g, d, s, c, top, starts, seed=31, dtype=jnp.bfloat16)
    st, nv = jnp.asarray(starts, jnp.int32), jnp.asarray(n_valid, jnp.int32)
    blocks = SelectedBlocks(block_k=block_k, num_warps=num_warps)
    got = np.asarray(jax.jit(lambda *a: selected_flash(*a, c, nv, blocks=blocks))(q, k, v, st, ids), np.float32)
    ref = np.asarray(jax.jit(lambda *a: selected_attention(*a, c, nv))(q, k, v, st, ids), np.float32)
    np.testing.assert_allclose(got[:, :900], ref[:, :900], rtol=5e-2, atol=5e-2)
    assert (got[:, 900:] == 0).all()
    sample = np.arange(0, 900, 89)
    pos = np.asarray(starts)[:, None] + sample
    mask = np.asarray(attention.chosen_from_ids(ids[:, sample], s // c))
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q[:, sample], k, v))
    keys = np.arange(s)
    see = (keys <= pos[..., None]) & np.where(keys < ((pos + 1) // c * c)[..., None], mask[..., keys // c], True)
    for j in range(len(sample)):
        seen = np.nonzero(see[0, j])[0]
        sc = np.einsum("kgd,ksd->kgs", q64[0, j], k64[0][:, seen]) / np.sqrt(d)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        w = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), v64[0][:, seen])
        assert np.abs(got[0, sample[j]] - w).mean() <= 1.5 * np.abs(ref[0, sample[j]] - w).mean() + 1e-6
