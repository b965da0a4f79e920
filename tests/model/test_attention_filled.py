"""Decode and verify attention off a GPU read only the filled part of a long cache (`attention.reads_filled_part`:
the QSA selection scored block group by block group up to the last new token; past the QSA budget, attention over
the selected keys alone, `pallas_kernels.selected_attention`; below it key block by key block): their outputs,
caches and greedy tokens equal the dense forms over all S positions (the path before it, still the GPU's), at fills
below and past the QSA budget, slots of different lengths, idle slots, and windows that run past the end of the
cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import strata_jax
from strata_jax.demo import DEMO_MODEL
from strata_jax.model import attention
from strata_jax.model.cache import AttentionCache, cache_len_for
from strata_jax.model.layers import rope_cos_sin

CTX = 2048  # 512 QSA blocks of 4: the budget (32 blocks) is a small part of it


@pytest.fixture(scope="module")
def demo():
    return strata_jax.load_model(DEMO_MODEL, dtype="float32")


def _attention_layer(demo) -> attention.Attention:
    net = nnx.merge(demo.graphdef, demo.state)
    layer = next(layer for layer in net.model.layers if not layer.linear)
    assert demo.config.qsa and CTX // demo.config.indexer_compress_ratio > demo.config.indexer_budget
    return layer.self_attn


def _random_cache(cfg, bsz: int, s: int, seed: int) -> AttentionCache:
    """Every position holds finite values (stale ones past a slot's length included), as a reused slot does."""
    rng = np.random.default_rng(seed)
    c, d = cfg.indexer_compress_ratio, cfg.indexer_head_dim
    kv = lambda: jnp.asarray(rng.standard_normal((bsz, cfg.num_kv_heads, s, cfg.head_dim)), jnp.float32)  # noqa
    return AttentionCache(k=kv(), v=kv(), index_k=jnp.asarray(rng.standard_normal((bsz, s, d)), jnp.float32),
                          block_keys=jnp.asarray(rng.standard_normal((bsz, s // c, d)), jnp.float32),
                          compress_ratio=c)


def _run(layer, x, cache, start, n_valid, filled: bool, monkeypatch):
    """The layer's output and cache with the filled-part loops on or off (a fresh trace for each)."""
    monkeypatch.setattr(attention, "reads_filled_part", lambda: filled)
    graphdef, state = nnx.split(layer)

    @jax.jit
    def call(state, x, cache, start, n_valid):
        return nnx.merge(graphdef, state)(x, cache, start, n_valid)

    return jax.tree_util.tree_map(np.asarray, call(state, x, cache, start, n_valid))


@pytest.mark.parametrize("t, starts, n_valid", [
    (1, [1500, 37, 0, 2047], [1, 1, 0, 1]),  # decode: past the budget, below it, idle, the cache's last position
    (5, [1501, 130, 9, 2045], [5, 3, 0, 5]),  # verify windows: padding, an idle row, a window past the cache's end
    (16, [803, 126, 0, 1], [16, 16, 16, 7]),  # the widest window the decode forms take
])
def test_filled_part_equals_dense_form(demo, monkeypatch, t, starts, n_valid):
    layer = _attention_layer(demo)
    cfg = demo.config
    s = cache_len_for(cfg, CTX)
    cache = _random_cache(cfg, len(starts), s, seed=t)
    x = jnp.asarray(np.random.default_rng(100 + t).standard_normal((len(starts), t, cfg.hidden_size)), jnp.float32)
    start, valid = jnp.asarray(starts, jnp.int32), jnp.asarray(n_valid, jnp.int32)
    out_filled, cache_filled = _run(layer, x, cache, start, valid, True, monkeypatch)
    out_dense, cache_dense = _run(layer, x, cache, start, valid, False, monkeypatch)
    assert np.all(np.isfinite(out_filled))
    np.testing.assert_allclose(out_filled, out_dense, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(cache_filled), jax.tree_util.tree_leaves(cache_dense)):
        np.testing.assert_array_equal(a, b)


def test_selection_follows_the_top_blocks(demo, monkeypatch):
    """The filled-part selection (block groups up to the last complete block) picks the same blocks as one top-k
    over every block of the cache: the budget's worth, all complete."""
    layer = _attention_layer(demo)
    cfg = demo.config
    s, c = cache_len_for(cfg, CTX), cfg.indexer_compress_ratio
    cache = _random_cache(cfg, 1, s, seed=7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((1, 1, cfg.hidden_size)), jnp.float32)
    start, valid = jnp.asarray([1700], jnp.int32), jnp.asarray([1], jnp.int32)
    graphdef, state = nnx.split(layer.indexer)
    for filled in (True, False):
        monkeypatch.setattr(attention, "reads_filled_part", lambda filled=filled: filled)
        positions = start[:, None]
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        chosen, _, _ = jax.jit(lambda st: nnx.merge(graphdef, st)(
            x, positions, valid, cache.index_k, cache.block_keys, cos, sin))(state)
        chosen = np.asarray(chosen)[0, 0]
        assert chosen.sum() == cfg.indexer_budget // c
        assert not chosen[(1700 + 1) // c:].any()  # only complete blocks
        if filled:
            picked = chosen
    np.testing.assert_array_equal(picked, chosen)


def _greedy(demo, prompts: list[list[int]], new_tokens: int, filled: bool, monkeypatch) -> tuple[list, np.ndarray]:
    """Prefills every prompt in one call and decodes `new_tokens` greedy tokens per row on a CTX-position cache
    (a fresh jit per mode); returns the tokens and the last step's logits."""
    monkeypatch.setattr(attention, "reads_filled_part", lambda: filled)

    def step(graphdef, state, tokens, cache, n_valid, rows):
        return nnx.merge(graphdef, state)(tokens, cache, n_valid, rows)

    run = jax.jit(functools.partial(step, demo.graphdef))
    bsz, longest = len(prompts), max(map(len, prompts))
    seqs = demo.start(bsz, CTX)
    tokens = np.zeros((bsz, longest), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    n_valid = np.asarray([len(p) for p in prompts], np.int32)
    contexts, cache = seqs.ple_context, seqs.cache
    out = [[] for _ in prompts]
    for _ in range(new_tokens + 1):
        rows, contexts = demo.ple_inputs(contexts, tokens, n_valid)
        logits, _, cache = run(demo.state, jnp.asarray(tokens), cache, jnp.asarray(n_valid),
                               tuple(jnp.asarray(r) for r in rows))
        last = np.asarray(logits)[np.arange(bsz), n_valid - 1]
        nxt = np.argmax(last, axis=-1).astype(np.int32)
        for i, t in enumerate(nxt):
            out[i].append(int(t))
        tokens, n_valid = nxt[:, None], np.ones(bsz, np.int32)
    return out, last


def test_greedy_tokens_unchanged_on_a_long_cache(demo, monkeypatch):
    tok = demo.tokenizer
    text = ("def reverse(s):\n    return s[::-1]\n\n\nclass Stack:\n    def push(self, x):\n"
            "        self.items.append(x)\n")
    ids = tok.encode(text * 14)
    prompts = [ids[:400], ids[:150]]  # past the QSA budget (128 tokens) by far, and just past it
    assert len(ids) >= 400
    tokens_filled, logits_filled = _greedy(demo, prompts, 16, True, monkeypatch)
    tokens_dense, logits_dense = _greedy(demo, prompts, 16, False, monkeypatch)
    assert tokens_filled == tokens_dense
    np.testing.assert_allclose(logits_filled, logits_dense, rtol=1e-4, atol=1e-4)
