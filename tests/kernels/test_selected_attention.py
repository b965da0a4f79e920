"""QSA attention over gathered keys (pallas_kernels.selected_attention) against `attention_jnp` with the dense
mask built in numpy from the same selection: chosen complete blocks plus the incomplete tail, padding tokens,
slots with fewer complete blocks than the budget, a tail block at the cache's end, a quantized cache, gradients;
and the model's indexer ids against its mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import attention_jnp, quantize_kv
from pallas_kernels.prefill_attention import dense_mask
from pallas_kernels.selected_attention import selected_attention
from strata_jax.model import attention


def _case(b, t, hk, g, d, s, c, top, starts, seed, dtype=jnp.float32):
    """Random q, k, v and, per token, `top` distinct complete blocks chosen at random (fewer when fewer are
    complete; `nb` fills the rest), as block ids and as the dense [B, T, S] mask."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, hk, g, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, hk, s, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, hk, s, d)), dtype)
    nb = s // c
    pos = np.asarray(starts)[:, None] + np.arange(t)
    ids = np.full((b, t, top), nb, np.int32)
    for i in range(b):
        for j in range(t):
            complete = (pos[i, j] + 1) // c
            pick = rng.permutation(min(complete, nb))[:top]
            ids[i, j, : len(pick)] = np.sort(pick)
    return q, k, v, jnp.asarray(ids)


def _want(q, k, v, starts, ids, c, n_valid=None, **scales):
    b, t = q.shape[:2]
    s = k.shape[2]
    positions = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(t)[None, :]
    limit = None if n_valid is None else jnp.minimum(jnp.asarray(starts) + jnp.asarray(n_valid), s)
    mask = dense_mask(positions, s, attention.chosen_from_ids(ids, s // c), c, limit)
    return np.asarray(attention_jnp(q, k, v, mask, **scales)), np.asarray(mask)


@pytest.mark.parametrize("b,t,hk,g,d,s,c,top,starts,n_valid", [
    (2, 9, 2, 3, 16, 256, 4, 5, [0, 120], None),  # slot 0: no complete block, then fewer than `top`
    (3, 33, 1, 2, 8, 512, 4, 8, [7, 200, 470], [33, 20, 33]),  # padding tokens; slot 2 runs into the cache's end
    (1, 1, 2, 2, 16, 128, 8, 3, [93], None),  # one decode token, its tail block partly filled
    (1, 16, 2, 2, 8, 96, 4, 4, [80], [16]),  # the chunk ends at the cache's last position (95)
])
def test_equals_the_dense_masked_form(b, t, hk, g, d, s, c, top, starts, n_valid):
    q, k, v, ids = _case(b, t, hk, g, d, s, c, top, starts, seed=t)
    nv = None if n_valid is None else jnp.asarray(n_valid, jnp.int32)
    got = np.asarray(jax.jit(selected_attention, static_argnums=5)(q, k, v, jnp.asarray(starts, jnp.int32), ids, c,
                                                                    nv))
    want, mask = _want(q, k, v, starts, ids, c, n_valid)
    seen = mask.any(-1)  # [B, T]: a token that sees nothing is 0 here, NaN in the dense form
    np.testing.assert_allclose(got[seen], want[seen], rtol=2e-5, atol=2e-6)
    assert (got[~seen] == 0).all()


def check_sees_exactly_its_blocks_and_tail(attend):
    """Values one-hot by position: the output is the mean of the values the token sees, so any position gathered
    wrongly (a wrong block, the tail past the token, a block not chosen) shows. ``attend(q, k, v, starts, ids, c)``:
    a form with `selected_attention`'s arguments."""
    b, t, hk, g, d, s, c = 1, 6, 1, 1, 64, 64, 4  # two chosen blocks per token
    q = jnp.zeros((b, t, hk, g, d), jnp.float32)  # equal scores: uniform weights over what is seen
    k = jnp.zeros((b, hk, s, d), jnp.float32)
    v = jnp.eye(s, d, dtype=jnp.float32)[None, None]
    starts = [37]  # positions 37..42: tails 36..37, 36..38, 36..39 -> complete, 40, 40..41, 40..42
    ids = jnp.asarray([[[2, 5]] * 4 + [[2, 9]] * 2], jnp.int32)
    got = np.asarray(attend(q, k, v, jnp.asarray(starts, jnp.int32), ids, c))[0, :, 0, 0]
    for j, p in enumerate(range(37, 43)):
        blocks = [2, 5] if j < 4 else [2, 9]
        seen = [x for blk in blocks for x in range(blk * c, blk * c + c)] + list(range((p + 1) // c * c, p + 1))
        want = np.zeros(d)
        want[seen] = 1 / len(seen)
        np.testing.assert_allclose(got[j], want, atol=1e-6, err_msg=f"token at {p}")


def test_a_token_sees_exactly_its_blocks_and_tail():
    check_sees_exactly_its_blocks_and_tail(selected_attention)


def test_quantized_cache():
    b, t, hk, g, d, s, c, top = 2, 8, 2, 2, 16, 256, 4, 6
    q, k, v, ids = _case(b, t, hk, g, d, s, c, top, [40, 180], seed=3)
    (kq, ks), (vq, vs) = quantize_kv(k.transpose(0, 2, 1, 3), jnp.int8), quantize_kv(v.transpose(0, 2, 1, 3),
                                                                                      jnp.int8)
    kq, vq, ks, vs = kq.transpose(0, 2, 1, 3), vq.transpose(0, 2, 1, 3), ks.transpose(0, 2, 1), vs.transpose(0, 2, 1)
    starts = jnp.asarray([40, 180], jnp.int32)
    got = np.asarray(selected_attention(q, kq, vq, starts, ids, c, k_scale=ks, v_scale=vs))
    want, _ = _want(q, kq, vq, [40, 180], ids, c, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_gradients_match_the_dense_form():
    """The demo trainer differentiates the attention layer: gathers transpose to scatter-adds."""
    b, t, hk, g, d, s, c, top = 1, 7, 1, 2, 8, 128, 4, 4
    q, k, v, ids = _case(b, t, hk, g, d, s, c, top, [50], seed=9)
    starts = jnp.asarray([50], jnp.int32)
    _, mask = _want(q, k, v, [50], ids, c)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    got = jax.grad(loss(lambda q, k, v: selected_attention(q, k, v, starts, ids, c)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: attention_jnp(q, k, v, jnp.asarray(mask))), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_indexer_ids_name_the_blocks_of_its_mask():
    rng = np.random.default_rng(1)
    b, t, h, d, nb, c, top = 2, 12, 2, 8, 200, 4, 5
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, nb, d)), jnp.float32)
    n_complete = (jnp.asarray([3, 500], jnp.int32)[:, None] + jnp.arange(t)[None, :] + 1) // c
    ids = attention.top_block_ids(q, keys, n_complete, top)
    np.testing.assert_array_equal(np.asarray(attention.chosen_from_ids(ids, nb)),
                                  np.asarray(attention._top_blocks_filled(q, keys, n_complete, top)))
    assert (np.asarray(ids)[0, 0] == nb).sum() == top - 1  # position 3: one complete block, the rest empty


def test_bad_shapes():
    q, k, v, ids = _case(1, 4, 1, 2, 8, 64, 4, 3, [10], seed=0)
    st = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="shapes do not match"):
        selected_attention(q, k[:, :, :32], v, st, ids, 4)
    with pytest.raises(ValueError, match="whole number of QSA blocks"):
        selected_attention(q, k, v, st, ids, 6)
    with pytest.raises(ValueError, match="ids must be"):
        selected_attention(q, k, v, st, ids[:, :2], 4)
