"""The benchmarks' routing bias: zero bias routes exactly like no bias; a Zipf bias skews selection, not weights."""

import jax.numpy as jnp
import numpy as np

from strata_jax.bench.tier import zipf_bias
from strata_jax.model.moe import route


def test_zero_bias_is_plain_routing():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
    ids, w = route(logits, 4, True)
    ids_b, w_b = route(logits, 4, True, jnp.zeros(32))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_b))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_b), rtol=1e-6)


def test_zipf_bias_skews_selection():
    rng = np.random.default_rng(1)
    e, k = 128, 8
    logits = jnp.asarray(rng.normal(size=(4000, e)), jnp.float32)
    bias = zipf_bias(e, 1.0, seed=0)
    ids, w = route(logits, k, True, jnp.asarray(bias))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=e)
    hot = np.argsort(-bias)
    assert counts[hot[:e // 4]].sum() > 0.6 * counts.sum()  # the top quarter by p gets most pairs
    probs = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
    picked = np.take_along_axis(probs, np.asarray(ids), axis=1)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(-1, keepdims=True), rtol=1e-5)
