"""The QSA indexer's block keys kept in the attention cache: written only for the blocks a step completes, they
equal the keys pooled from scratch from the raw index keys (every complete block, after chunks of odd sizes, idle
rows, decode, a verify whose rejected draft completed a block, the MTP layer's drafting chain), outputs stay the
transformers fixture's, a decode step never pools the whole index-key cache, and prefix snapshots carry only the
prefix's blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import strata_jax
from conftest import FIXTURES
from strata_jax.engine.prefix_cache import PrefixCache
from strata_jax.model.cache import AttentionCache, map_kv_positions
from strata_jax.model.decoder import rollback
from strata_jax.model.layers import apply_rope, rope_cos_sin

TOL = 1e-4
MTP_K = 3


@pytest.fixture(scope="module")
def loaded():
    path = FIXTURES / "ckpt" / "qwen4_exp_causal"
    model = strata_jax.load_model(path)
    assert model.config.qsa and model.has_mtp
    return model, dict(np.load(path / "reference.npz"))


def _advance(graphdef, state, tokens, next_tokens, cache, n_valid, rows):
    model = nnx.merge(graphdef, state)
    logits, hidden, cache = model(tokens, cache, n_valid, rows)
    _, cache = model.mtp_drafts(hidden, next_tokens, cache, n_valid, MTP_K)
    return logits, cache


def _verify(graphdef, state, tokens, next_tokens, cache, n_valid, n_keep, rows):
    model = nnx.merge(graphdef, state)
    logits, hidden, after, replays = model.verify(tokens, cache, n_valid, rows)
    cache = rollback(cache, after, replays, n_keep)
    _, cache = model.mtp_drafts(hidden, next_tokens, cache, n_keep, MTP_K)
    return logits, cache


def _fresh_block_keys(indexer, index_k, cfg) -> np.ndarray:
    """Every block's key pooled from the whole index-key cache, as the indexer did before it kept them."""
    b, s, d = index_k.shape
    c = cfg.indexer_compress_ratio
    pooled = jnp.mean(index_k.reshape(b, s // c, c, d).astype(jnp.float32), axis=2).astype(index_k.dtype)
    pooled = indexer.k_layernorm(pooled)
    cos, sin = rope_cos_sin(jnp.arange(s // c) * c, cfg.rotary_dim, cfg.rope_theta)
    return np.asarray(apply_rope(pooled[:, :, None, :], cos, sin)[:, :, 0, :])


def _attention_caches(lm, cache):
    """(indexer, attention cache, lengths) of every attention layer, the MTP layer's included."""
    out = [(layer.self_attn.indexer, lc.mixer, cache.lengths)
           for layer, lc in zip(lm.model.layers, cache.layers) if isinstance(lc.mixer, AttentionCache)]
    out.append((lm.mtp.layers[0].self_attn.indexer, cache.mtp.mixer, cache.mtp_lengths))
    return out


def _check_complete_blocks(lm, cache, cfg) -> int:
    """Asserts every complete block's cached key equals its fresh pool; returns how many blocks were compared."""
    c, compared = cfg.indexer_compress_ratio, 0
    for indexer, mixer, lengths in _attention_caches(lm, cache):
        fresh = _fresh_block_keys(indexer, mixer.index_k, cfg)
        kept = np.asarray(mixer.block_keys)
        for b, length in enumerate(np.asarray(lengths)):
            n = int(length) // c
            np.testing.assert_allclose(kept[b, :n], fresh[b, :n], rtol=1e-6, atol=1e-6)
            compared += n
    return compared


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def test_kept_block_keys_equal_a_fresh_pool_through_chunks_decode_and_a_rollback(loaded):
    """Two rows through chunks of odd sizes (one row idle for a chunk), decode tokens and a verify window whose
    rejected drafts complete a block in each row (then the real tokens complete it again), with the MTP layer
    drafting after every step: after each step every complete block's key equals the fresh pool of its raw keys
    (main and MTP caches), an idle row's block keys are untouched, and the logits of every real token are the
    transformers fixture's (greedy tokens included)."""
    model, ref = loaded
    cfg, c = model.config, model.config.indexer_compress_ratio
    ids, want = ref["input_ids"], ref["logits"]
    lm = nnx.merge(model.graphdef, model.state)
    advance = jax.jit(functools.partial(_advance, model.graphdef))
    verify = jax.jit(functools.partial(_verify, model.graphdef))
    seqs = model.start(2, 64)
    cache, contexts, pos = seqs.cache, seqs.ple_context, np.zeros(2, int)

    def window(width, n_valid, wrong_from=None):
        tokens = np.zeros((2, width), np.int32)
        nxt = np.zeros((2, width), np.int32)
        for b in range(2):
            real = ids[b, pos[b] : pos[b] + width]
            tokens[b, : len(real)] = real
            after = ids[b, pos[b] + 1 : pos[b] + width + 1]
            nxt[b, : len(after)] = after
            if wrong_from is not None:
                tokens[b, wrong_from[b] :] = (tokens[b, wrong_from[b] :] + 1) % cfg.vocab_size
        rows, _ = model.ple_inputs(contexts, tokens, np.asarray(n_valid))
        return tokens, nxt, tuple(jnp.asarray(r, model.dtype) for r in rows)

    def check_logits(logits, n_real):
        for b in range(2):
            got, ref_b = logits[b, : n_real[b]], want[b, pos[b] : pos[b] + n_real[b]]
            if n_real[b]:
                assert _rel(got, ref_b) <= TOL
                np.testing.assert_array_equal(got.argmax(-1), ref_b.argmax(-1))

    compared = 0
    for width, n_valid in [(7, (7, 0)), (13, (13, 5)), (1, (1, 1)), (1, (1, 1)), (9, (3, 9))]:
        tokens, nxt, rows = window(width, n_valid)
        idle_before = [np.asarray(m.block_keys[1]) for _, m, _ in _attention_caches(lm, cache)]
        logits, cache = advance(model.state, jnp.asarray(tokens), jnp.asarray(nxt), cache,
                                jnp.asarray(n_valid, jnp.int32), rows)
        check_logits(np.asarray(logits), n_valid)
        if n_valid[1] == 0:
            for before, (_, m, _) in zip(idle_before, _attention_caches(lm, cache)):
                np.testing.assert_array_equal(np.asarray(m.block_keys[1]), before)
        contexts = model.ple_next_context(contexts, tokens, np.asarray(n_valid))
        pos += n_valid
        compared += _check_complete_blocks(lm, cache, cfg)
    assert list(pos) == [25, 16]

    # Verify 5 tokens per row; keep 2 of row 0 (position 27, which completes block 6, is a rejected draft) and 1 of
    # row 1 (position 16 kept; 17..20 rejected, 19 completes block 4).
    n_keep = np.asarray([2, 1])
    tokens, nxt, rows = window(5, (5, 5), wrong_from=n_keep)
    logits, cache = verify(model.state, jnp.asarray(tokens), jnp.asarray(nxt), cache, jnp.asarray([5, 5], jnp.int32),
                           jnp.asarray(n_keep, jnp.int32), rows)
    check_logits(np.asarray(logits), n_keep)
    contexts = model.ple_next_context(contexts, tokens, n_keep)
    pos += n_keep
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos)
    compared += _check_complete_blocks(lm, cache, cfg)
    for _, mixer, _ in _attention_caches(lm, cache)[:-1]:
        # The rejected drafts' blocks were written (they completed them), with keys the real tokens will replace.
        for b in range(2):
            assert np.abs(np.asarray(mixer.block_keys[b, pos[b] // c])).max() > 0

    for width, n_valid in [(1, (1, 1)), (11, (11, 11)), (1, (1, 1))]:
        tokens, nxt, rows = window(width, n_valid)
        logits, cache = advance(model.state, jnp.asarray(tokens), jnp.asarray(nxt), cache,
                                jnp.asarray(n_valid, jnp.int32), rows)
        check_logits(np.asarray(logits), n_valid)
        contexts = model.ple_next_context(contexts, tokens, np.asarray(n_valid))
        pos += n_valid
        compared += _check_complete_blocks(lm, cache, cfg)
    assert list(pos) == [40, 30]
    assert compared > 200


def _jaxpr_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _jaxpr_eqns(inner)


@pytest.mark.parametrize("t", [1, 5])
def test_a_decode_or_verify_step_never_pools_the_whole_index_key_cache(loaded, t):
    """The step's jaxpr reads the raw index keys [B, S, d] only through a scatter (the new keys) and a gather (the
    window of blocks the step can complete), and nothing has the shape of the whole cache's blocks [B, S/c, c, d]:
    pooling costs what the step's tokens touch, whatever the cache length."""
    model, _ = loaded
    cfg = model.config
    b, s, d, c = 2, 64, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    seqs = model.start(b, s)
    rows = tuple(jnp.zeros((b, t, cfg.ple_embed_dim), model.dtype) for _ in cfg.ple_layers)

    def step(state, tokens, cache, n_valid):
        return nnx.merge(model.graphdef, state)(tokens, cache, n_valid, rows)

    jaxpr = jax.make_jaxpr(step)(model.state, jnp.zeros((b, t), jnp.int32), seqs.cache, jnp.ones((b,), jnp.int32))
    whole_keys, whole_blocks = (b, s, d), (b, s // c, c, d)
    readers = []
    for eqn in _jaxpr_eqns(jaxpr.jaxpr):
        shapes = [tuple(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars)]
        assert whole_blocks not in shapes, eqn
        if any(tuple(getattr(v.aval, "shape", ())) == whole_keys for v in eqn.invars):
            readers.append(eqn.primitive.name)
    call_like = {"pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"}
    n_attn = sum(not cfg.layer_is_linear(i) for i in range(cfg.num_layers))
    assert sorted(r for r in readers if r not in call_like) == ["gather"] * n_attn + ["scatter"] * n_attn


def test_prefix_snapshots_cut_and_pad_whole_blocks(loaded):
    """`map_positions` cuts the block keys with the positions (L positions keep L // c blocks, L need not be a
    multiple of c) and pads them back; a prefix-cache snapshot restored into a fresh cache continues exactly."""
    model, ref = loaded
    cfg, c = model.config, model.config.indexer_compress_ratio
    ids, want = ref["input_ids"][:1], ref["logits"][:1]
    seqs = model.start(1, 64)
    _, _, seqs = model.step(seqs, ids[:, :22])
    full = seqs.cache
    first = next(lc.mixer for lc in full.layers if isinstance(lc.mixer, AttentionCache))
    for length in (24, 22, 64):
        cut = map_kv_positions(full, lambda x, axis, n=length: x[(slice(None),) * axis + (slice(0, n),)])
        part = next(lc.mixer for lc in cut.layers if isinstance(lc.mixer, AttentionCache))
        assert part.index_k.shape[1] == length and part.block_keys.shape[1] == length // c
        np.testing.assert_array_equal(np.asarray(part.block_keys), np.asarray(first.block_keys[:, : length // c]))

    host = jax.tree_util.tree_map(np.asarray, full)
    prefix = PrefixCache(1 << 30, kv_block=c)
    prefix.insert(ids[0, :22].tolist(), host)
    snap = prefix.lookup(ids[0, :30].tolist())
    stored = next(lc.mixer for lc in snap.state.layers if isinstance(lc.mixer, AttentionCache))
    assert stored.block_keys.shape[1] == 24 // c  # the prefix's blocks only
    restored = jax.tree_util.tree_map(jnp.asarray, PrefixCache.restore(snap, full.max_len))
    back = next(lc.mixer for lc in restored.layers if isinstance(lc.mixer, AttentionCache))
    np.testing.assert_array_equal(np.asarray(back.block_keys[:, : 24 // c]), np.asarray(first.block_keys[:, :6]))
    assert not np.asarray(back.block_keys[:, 24 // c :]).any()
    seqs.cache = restored
    logits, _, _ = model.step(seqs, ids[:, 22:40])
    assert _rel(logits, want[:, 22:40]) <= TOL
    assert cfg.qsa and 40 > cfg.indexer_budget  # the continuation selects blocks from the restored keys
