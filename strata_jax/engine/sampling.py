"""Token sampling inside the jitted step, with per-slot parameters as arrays.

Work only some slots need (truncation's sort, draws, grammar masks, log-probabilities) is optional. With
`lax.cond` ("cond") it is skipped when no slot needs it, but on a GPU each `cond` copies its predicate to the host
in the middle of the step: the host cannot queue the next step while this one runs. "select" computes both sides
and selects, leaving the step free of host synchronisation. On the H200 (2026-12-03, Flash-Next shapes, same run)
"select" took decode[1] from 10.30 to 6.12 ms back to back and one user of the engine from 62.2 to 78.2 tok/s;
decode[8] was unchanged (9.81 / 9.69 ms). With "select" a step pays the truncation sort on every step: ~1.65 ms at
32 slots (measured earlier), not yet weighed against the sync there. Verify windows sample slots x window positions
rows: 8 users with chained windows of 5 (40 rows) ran 85.6 tok/s each with "select" against 69.5 without speculation
(H100, 2026-12-05), where "cond" had left them at 0.98x (a sync in every window stops the chaining). "auto" (the
default) is "select" on a GPU for steps that sample at most `SELECT_MAX_ROWS` rows (up to 8 slots with windows of 9)
and "cond" above that and off a GPU (no sync to save on the CPU); 32 slots' decode (32 rows) now selects too, its
sort against the sync not yet measured. Steps keep the mode they were traced with (`set_branch_mode`).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

BRANCH_MODES = ("auto", "cond", "select")
SELECT_MAX_ROWS = 72  # "auto": select up to this many sampled rows (8 slots x windows of 9; measured up to 40)
_mode = "auto"


def set_branch_mode(mode: str) -> None:
    """How sampling's optional work is skipped in steps traced from now on: "cond" (`lax.cond`), "select" (both
    sides computed, no host synchronisation) or "auto" (the default: select on a GPU)."""
    global _mode
    if mode not in BRANCH_MODES:
        raise ValueError(f"branch mode must be one of {', '.join(BRANCH_MODES)}, got {mode!r}")
    _mode = mode


def branch_mode(rows: int = 1) -> str:
    """The mode a step sampling `rows` rows traced now uses ("auto" resolved for this backend and size)."""
    if _mode == "auto":
        return "select" if jax.default_backend() == "gpu" and rows <= SELECT_MAX_ROWS else "cond"
    return _mode


def _branch(pred: jax.Array, on_true: Callable, on_false: Callable, rows: int):
    if branch_mode(rows) == "cond":
        return jax.lax.cond(pred, on_true, on_false)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true(), on_false())


def processed_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits [S, ..., V] after temperature, top-k and top-p (per-slot parameters [S]); removed tokens are -inf.

    This is the distribution a request samples from; speculative verification keeps exactly it."""
    shape = logits.shape
    flat = logits.astype(jnp.float32).reshape(shape[0], -1, shape[-1])
    scaled = flat / jnp.maximum(temperature, 1e-6)[:, None, None]
    vocab = shape[-1]

    def truncated():
        ordered = jnp.sort(scaled, axis=-1)[..., ::-1]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(ordered, jnp.broadcast_to((k - 1)[:, None, None], ordered.shape[:2] + (1,)), axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        # Keep the smallest prefix of sorted tokens whose mass reaches top_p (always at least one).
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.maximum(jnp.sum(before < top_p[:, None, None], axis=-1, keepdims=True) - 1, 0)
        pth = jnp.take_along_axis(ordered, cutoff, axis=-1)
        return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)

    # Sorting every slot's vocabulary costs 1.65 ms per step at 32 slots on an H200: only when some slot truncates.
    cuts = jnp.any((top_k > 0) & (top_k < vocab)) | jnp.any(top_p < 1.0)
    return _branch(cuts, truncated, lambda: scaled, flat.shape[0] * flat.shape[1]).reshape(shape)


def position_key(seed: jax.Array, position: jax.Array, stream: int = 0) -> jax.Array:
    """The random key of one (request seed, token position): sampling never depends on batch composition."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), stream)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    position: jax.Array,
) -> jax.Array:
    """Next token per row of logits [S, V]: argmax where temperature is 0, else a draw from `processed_logits`
    with the key of (seed, position)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        masked = processed_logits(logits, temperature, top_k, top_p)
        keys = jax.vmap(position_key)(seed, position)
        out = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(temperature > 0, out, greedy)

    return _branch(jnp.any(temperature > 0), drawn, lambda: greedy, math.prod(logits.shape[:-1]))


def apply_token_mask(logits: jax.Array, mask: jax.Array, constrained: jax.Array) -> jax.Array:
    """Logits [S, ..., V] with the tokens a packed mask [S, ..., ceil(V / 32)] (int32; bit i of word w allows token
    32 w + i) does not allow set to -inf, when `constrained` (a scalar bool: some slot has a grammar; the others'
    masks allow everything). Unconstrained steps skip the unpacking: it reads and writes S x V values."""

    def masked():
        bits = (mask[..., None].astype(jnp.uint32) >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [..., W, 32]
        allowed = bits.reshape(*mask.shape[:-1], -1)[..., : logits.shape[-1]].astype(bool)
        return jnp.where(allowed, logits, -jnp.inf)

    return _branch(constrained, masked, lambda: logits, math.prod(logits.shape[:-1]))


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int, wanted: jax.Array) -> tuple[jax.Array, ...]:
    """Log-probabilities of the model's raw distribution (log_softmax of `logits` [S, ..., V], before temperature,
    top-k/top-p and any grammar mask): of `tokens` [S, ...] and the k most likely tokens, (logprob [S, ...], top ids
    [S, ..., k], top logprobs [S, ..., k]). Only when `wanted` (a scalar bool: some slot asked); zeros otherwise,
    since the top-k reads the whole vocabulary of every slot."""
    shape = tokens.shape

    def computed():
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(logp, k)
        return chosen, top_ids.astype(jnp.int32), top_lp

    def skipped():
        return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (k,), jnp.int32), jnp.zeros(shape + (k,), jnp.float32))

    return _branch(wanted, computed, skipped, math.prod(logits.shape[:-1]))
