"""Speculative decoding: the on-device acceptance rule (the drafters that guess are in drafters.py).

Acceptance keeps the target model's output exactly: greedy slots accept the longest prefix of drafts equal to the
target's argmax, then add the target's own next token; sampling slots accept draft d with probability p(d) (the
draft is a point guess, q = one-hot) and on rejection draw from p with d removed, which leaves every emitted token
distributed exactly as p (the request's processed distribution).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.engine.sampling import position_key, processed_logits


def accept(
    logits: jax.Array,
    drafts: jax.Array,
    n_drafts: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    start: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """logits [S, T, V] of a verify window (last token + T-1 drafts), drafts [S, T-1], n_drafts [S].

    Returns (accepted drafts per slot [S], tokens [S, T]): tokens[:, :a] are the accepted drafts and tokens[:, a]
    the target's own next token. Position of window index i is start + i + 1 (for the random keys).
    """
    s, t, _ = logits.shape
    positions = start[:, None] + 1 + jnp.arange(t)[None, :]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, T]
    masked = processed_logits(logits, temperature, top_k, top_p)
    probs = jax.nn.softmax(masked, axis=-1)
    padded = jnp.concatenate([drafts, jnp.zeros((s, 1), drafts.dtype)], axis=1)  # [S, T]
    keys = jax.vmap(jax.vmap(position_key, in_axes=(None, 0, None)), in_axes=(0, 0, None))
    u = jax.vmap(jax.vmap(jax.random.uniform))(keys(seed, positions, 1))
    p_draft = jnp.take_along_axis(probs, padded[..., None], axis=-1)[..., 0]
    sampled_ok = u < p_draft
    ok = jnp.where(temperature[:, None] > 0, sampled_ok, padded == greedy)
    ok = ok & (jnp.arange(t)[None, :] < n_drafts[:, None])
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    # The token after the accepted prefix: on a rejection, p without the rejected draft; after all drafts, p.
    rejected = jnp.arange(t)[None, :] < n_drafts[:, None]
    residual = jnp.where(rejected[..., None] & (jnp.arange(logits.shape[-1]) == padded[..., None]), -jnp.inf, masked)
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys(seed, positions, 2), residual).astype(jnp.int32)
    own = jnp.where(temperature[:, None] > 0, drawn, greedy)
    idx = jnp.arange(t)[None, :]
    tokens = jnp.where(idx < n_acc[:, None], padded, jnp.take_along_axis(own, n_acc[:, None], axis=1))
    return n_acc, tokens



def window_inputs(drafts_fn, out: jax.Array, accepted: jax.Array, lengths: jax.Array, step_drafts: jax.Array,
                  want: jax.Array, active: jax.Array, state, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The next verify window, built on the device from the window before's outputs (chained windows: the host
    does not read them first).

    out [S, W'] and accepted [S]: the window before's emitted tokens (its last emitted one, out[s, accepted[s]],
    starts the new window); lengths [S]: each slot's history length before that window's emitted tokens, so that
    lengths + accepted + 1 is the length now (the new window's first token is its last). The first window of a
    chain passes out = last token [S, 1], accepted = 0 and lengths = history length - 1. `drafts_fn(state,
    step_drafts, lengths, k)` (`DeviceDrafter.device_drafts`) guesses; each slot takes at most want[s] of them;
    inactive slots get an empty window. Returns (tokens [S, width], n_valid [S], lengths [S])."""
    k = width - 1
    first = jnp.take_along_axis(out, accepted[:, None], axis=1)
    lengths = lengths + accepted + 1
    guesses, real = drafts_fn(state, step_drafts, lengths, k)
    n_drafts = jnp.clip(jnp.minimum(real, want), 0, k)
    kept = jnp.where(jnp.arange(k)[None, :] < n_drafts[:, None], guesses, 0)
    tokens = jnp.concatenate([first.astype(jnp.int32), kept.astype(jnp.int32)], axis=1)
    return tokens, jnp.where(active, 1 + n_drafts, 0).astype(jnp.int32), lengths
