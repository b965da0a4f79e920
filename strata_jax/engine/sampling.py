"""Token sampling inside the jitted step, with per-slot parameters as arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    position: jax.Array,
) -> jax.Array:
    """Next token per row of logits [S, V].

    temperature [S] (0 = greedy), top_k [S] (0 = off), top_p [S] (1 = off), seed [S] and position [S]: the
    random key of a row depends only on (seed, position), so a request samples the same tokens whatever else
    shares the batch.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    # Keep the smallest prefix of sorted tokens whose mass reaches top_p (always at least one).
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_idx = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1) - 1, 0)
    pth = jnp.take_along_axis(ordered, cutoff_idx[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
