"""Prefill attention (pallas_kernels.prefill_attention): the blocked form against `attention_jnp` with the dense
mask, for plain causal chunks and QSA block selections; it reads nothing past the chunk's last key block, builds no
[B, T, S] array, and differentiates like the dense form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from pallas_kernels.decode_attention import attention_jnp
from pallas_kernels.prefill_attention import dense_mask, prefill_attention
from strata_jax.model import attention


def _qkv(b, t, hk, g, d, s, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, hk, g, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, hk, s, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, hk, s, d)), dtype)
    return q, k, v


def _chosen(starts, t, s, c, top, seed):
    """The QSA indexer's rule in numpy on random block scores: per token, the `top` best complete blocks (ties to the
    lower index), nothing else; when there are at most `top` blocks in the cache, every complete block."""
    rng = np.random.default_rng(seed)
    nb = s // c
    pos = np.asarray(starts)[:, None] + np.arange(t)
    complete = np.arange(nb)[None, None, :] < ((pos + 1) // c)[..., None]
    if nb <= top:
        return complete
    scores = np.where(complete, rng.normal(size=complete.shape), -np.inf)
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :top]
    chosen = np.zeros_like(complete)
    np.put_along_axis(chosen, best, True, axis=-1)
    return chosen & complete


def _numpy_mask(starts, t, s, chosen=None, c=1):
    """The dense [B, T, S] mask as the model built it before the block form: causal, and with QSA the chosen complete
    blocks plus the always-visible incomplete tail."""
    pos = np.asarray(starts)[:, None] + np.arange(t)
    keys = np.arange(s)
    mask = keys[None, None, :] <= pos[..., None]
    if chosen is not None:
        in_complete = keys[None, None, :] < ((pos + 1) // c * c)[..., None]
        mask &= np.where(in_complete, chosen[..., keys // c], True)
    return mask


def _prefill(q, k, v, starts, chosen=None, **kw):
    f = jax.jit(lambda q, k, v, st, ch: prefill_attention(q, k, v, st, chosen=ch, **kw))
    return np.asarray(f(q, k, v, jnp.asarray(starts, jnp.int32), None if chosen is None else jnp.asarray(chosen)))


@pytest.mark.parametrize("b,t,hk,g,d,s,starts,block_k", [
    (1, 17, 1, 2, 16, 64, [0], 64),  # one block, the chunk from position 0
    (3, 37, 2, 3, 16, 256, [0, 101, 219], 64),  # odd starts, T not a multiple of the block; slot 2 ends at S
    (2, 50, 2, 2, 8, 200, [13, 140], 64),  # S not a multiple of the block: the last block is moved back
])
def test_causal_matches_dense(b, t, hk, g, d, s, starts, block_k):
    q, k, v = _qkv(b, t, hk, g, d, s, seed=t + s)
    want = np.asarray(attention_jnp(q, k, v, jnp.asarray(_numpy_mask(starts, t, s))))
    got = _prefill(q, k, v, starts, block_k=block_k)
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,t,s,c,top,starts,block_k", [
    (1, 40, 64, 4, 2, [0], 16),  # the fixture's QSA shape: budget 8 tokens, a chunk far past it
    (3, 33, 256, 4, 5, [3, 90, 171], 32),  # several slots at odd starts, T past the budget
    (2, 29, 96, 8, 3, [0, 55], 40),  # block_k rounded down to whole QSA blocks (32); S not a multiple of it
    (1, 24, 32, 4, 8, [5], 64),  # fewer blocks than the budget: every complete block; one key block (S)
])
def test_qsa_selection_matches_dense(b, t, s, c, top, starts, block_k):
    q, k, v = _qkv(b, t, 2, 2, 16, s, seed=s + t)
    chosen = _chosen(starts, t, s, c, top, seed=t)
    mask = _numpy_mask(starts, t, s, chosen, c)
    assert (mask.sum(-1) < _numpy_mask(starts, t, s).sum(-1)).any() or s // c <= top  # the selection drops keys
    want = np.asarray(attention_jnp(q, k, v, jnp.asarray(mask)))
    got = _prefill(q, k, v, starts, chosen, compress_ratio=c, block_k=block_k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    pos = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(t)[None, :]
    np.testing.assert_array_equal(np.asarray(dense_mask(pos, s, jnp.asarray(chosen), c)), mask)


def test_reads_nothing_past_the_last_key_block():
    """NaN keys and values from the block after the chunk's last position on leave the output alone (inside the
    last block they are multiplied by 0, as in the dense form, so the cache holds finite numbers there)."""
    b, t, s, bk = 2, 21, 512, 32
    starts = [40, 3]
    q, k, v = _qkv(b, t, 1, 2, 16, s, seed=5)
    want = np.asarray(attention_jnp(q, k, v, jnp.asarray(_numpy_mask(starts, t, s))))
    end = -(-(max(starts) + t) // bk) * bk
    k, v = k.at[:, :, end:].set(jnp.nan), v.at[:, :, end:].set(jnp.nan)
    got = _prefill(q, k, v, starts, block_k=bk)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_padding_tokens_and_an_idle_slot():
    """n_valid: real tokens match the dense form, no key past start + n_valid is read, a slot with no real token
    gets zeros."""
    b, t, s = 3, 20, 128
    starts, n_valid = [7, 60, 0], [13, 20, 0]
    q, k, v = _qkv(b, t, 2, 2, 16, s, seed=9)
    want = np.asarray(attention_jnp(q, k, v, jnp.asarray(_numpy_mask(starts, t, s))))
    f = jax.jit(lambda q, k, v, st, n: prefill_attention(q, k, v, st, n, block_k=16))
    got = np.asarray(f(q, k, v, jnp.asarray(starts), jnp.asarray(n_valid)))
    for i, n in enumerate(n_valid):
        np.testing.assert_allclose(got[i, :n], want[i, :n], rtol=1e-5, atol=1e-5)
    assert np.all(got[2] == 0) and np.isfinite(got).all()


def test_builds_no_dense_mask():
    """No value of the traced computation has both the chunk's T and the cache's S positions."""
    b, t, s, c = 1, 48, 1024, 4
    q, k, v = _qkv(b, t, 2, 2, 16, s, seed=1)
    chosen = jnp.zeros((b, t, s // c), bool)
    jaxpr = jax.make_jaxpr(lambda *a: prefill_attention(*a, compress_ratio=c, block_k=64))(
        q, k, v, jnp.zeros((b,), jnp.int32), None, chosen)

    def shapes(jx):
        for eqn in jx.eqns:
            for var in eqn.outvars:
                yield getattr(var.aval, "shape", ())
            for sub in jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    seen = list(shapes(jaxpr.jaxpr))
    assert any(64 in sh for sh in seen)
    assert not [sh for sh in seen if t in sh and s in sh]


def test_bf16_close_to_the_dense_form():
    b, t, s, c = 2, 32, 128, 4
    starts = [10, 77]
    q, k, v = _qkv(b, t, 2, 4, 32, s, seed=2, dtype=jnp.bfloat16)
    chosen = _chosen(starts, t, s, c, 4, seed=3)
    mask = jnp.asarray(_numpy_mask(starts, t, s, chosen, c))
    want = np.asarray(attention_jnp(q, k, v, mask), np.float32)
    got = _prefill(q, k, v, starts, chosen, compress_ratio=c, block_k=32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=3e-2, atol=3e-2)


def test_gradient_goes_through_the_dense_form():
    """jax.grad works (the demo trainer runs the attention layer under it) and equals the dense form's gradient."""
    b, t, s, c = 2, 20, 64, 4
    starts = [0, 30]
    q, k, v = _qkv(b, t, 1, 2, 8, s, seed=4)
    chosen = _chosen(starts, t, s, c, 3, seed=5)
    mask = jnp.asarray(_numpy_mask(starts, t, s, chosen, c))
    st, ch = jnp.asarray(starts, jnp.int32), jnp.asarray(chosen)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    got = jax.jit(jax.grad(loss(lambda q, k, v: prefill_attention(q, k, v, st, chosen=ch, compress_ratio=c,
                                                                   block_k=16)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: attention_jnp(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_bad_shapes():
    q, k, v = _qkv(1, 20, 1, 2, 16, 64, seed=0)
    st = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="shapes do not match"):
        prefill_attention(q, k[:, :, :32], v, st)
    with pytest.raises(ValueError, match="whole number of QSA blocks"):
        prefill_attention(q, k, v, st, chosen=jnp.zeros((1, 20, 10), bool), compress_ratio=6)
    with pytest.raises(ValueError, match="chosen must be"):
        prefill_attention(q, k, v, st, chosen=jnp.zeros((1, 20, 8), bool), compress_ratio=4)


def test_indexer_selection_over_the_filled_blocks_matches_one_top_k(monkeypatch):
    """The prefill chunk's QSA selection (a running top-k over groups of blocks, up to the last complete one) equals
    one `top_k` over every block of the cache with the incomplete ones masked, ties included (integer-valued q and
    keys make many equal scores, zeros among them)."""
    monkeypatch.setattr(attention, "SELECT_BLOCKS", 48)
    rng = np.random.default_rng(0)
    b, t, h, d, nb, c, top = 2, 40, 2, 8, 300, 4, 6
    q = jnp.asarray(rng.integers(-2, 3, size=(b, t, h, d)), jnp.float32)
    keys = jnp.asarray(rng.integers(-1, 2, size=(b, nb, d)), jnp.float32)
    starts = jnp.asarray([2, 700], jnp.int32)  # slot 0: fewer complete blocks than `top` at first; 1: a group past 48
    n_complete = (starts[:, None] + jnp.arange(t)[None, :] + 1) // c
    complete = jnp.arange(nb)[None, None, :] < n_complete[..., None]
    masked = jnp.where(complete, attention._block_scores(q, keys), -jnp.inf)
    _, best = jax.lax.top_k(masked, top)
    want = np.zeros((b, t, nb), bool)
    np.put_along_axis(want, np.asarray(best), True, axis=-1)
    want &= np.asarray(complete)
    got = jax.jit(attention._top_blocks_filled, static_argnums=3)(q, keys, n_complete, top)
    assert (np.asarray(masked) == 0).sum() > 1000  # ties at zero
    np.testing.assert_array_equal(np.asarray(got), want)
