"""The jitted, fixed-shape device functions of the engine, all with the slot cache donated:

- `prefill`: one chunk of one slot's prompt (batch 1, chunk size C; the last chunk is masked by `n_valid`),
  sampling the next token from the last real position;
- `decode`: one token for every slot at once, inactive slots masked (their state does not move);
- `reset` / `read` / `write`: a slot's state, for new requests and prefix-cache snapshots.
Slot indices are traced values: one compilation serves every slot.
"""

from __future__ import annotations

import concurrent.futures
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.loaded_model import LoadedModel
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.placement import ExpertPlacement, PlacementConfig
from strata_jax.engine.sampling import sample
from strata_jax.engine.speculative import accept
from strata_jax.model.cache import AttentionCache, ModelCache, init_cache
from strata_jax.model.decoder import rollback
from strata_jax.model.moe import RoutingCounts


def take_slot(cache: ModelCache, slot: jax.Array) -> ModelCache:
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), cache)


def put_slot(cache: ModelCache, slot: jax.Array, sub: ModelCache) -> ModelCache:
    return jax.tree_util.tree_map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, slot, axis=0), cache, sub)


def _no_drafts(batch: int) -> jax.Array:
    return jnp.zeros((batch, 0), jnp.int32)


def _prefill(mtp_k, graphdef, state, cache, slot, tokens, n_valid, next_token, rows, temperature, top_k, top_p, seed):
    """One prompt chunk of one slot. `next_token` is the prompt token after the chunk (-1 after the last chunk:
    then the sampled token follows). With MTP drafting (mtp_k > 0) the chunk's pairs enter the MTP cache and the
    returned drafts guess the tokens after the sampled one."""
    model = nnx.merge(graphdef, state)
    sub = take_slot(cache, slot)
    logits, hidden, sub = model(tokens, sub, n_valid, rows)
    last = jax.lax.dynamic_index_in_dim(logits[0], n_valid[0] - 1, axis=0, keepdims=True)
    token = sample(last, temperature, top_k, top_p, seed, sub.lengths)
    drafts = _no_drafts(1)
    if mtp_k:
        follow = jnp.where(next_token[0] >= 0, next_token[0], token[0])
        shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((1, 1), tokens.dtype)], axis=1)
        nxt = jnp.where(jnp.arange(tokens.shape[1])[None] == n_valid[0] - 1, follow, shifted)
        drafts, sub = model.mtp_drafts(hidden, nxt, sub, n_valid, mtp_k)
    return token[0], drafts[0], put_slot(cache, slot, sub), nnx.state(model, RoutingCounts)


def _decode(mtp_k, graphdef, state, cache, tokens, active, rows, temperature, top_k, top_p, seed):
    model = nnx.merge(graphdef, state)
    n_valid = active.astype(jnp.int32)
    logits, hidden, cache = model(tokens[:, None], cache, n_valid, rows)
    out = sample(logits[:, 0], temperature, top_k, top_p, seed, cache.lengths)
    drafts = _no_drafts(tokens.shape[0])
    if mtp_k:
        drafts, cache = model.mtp_drafts(hidden, out[:, None], cache, n_valid, mtp_k)
    return out, drafts, cache, nnx.state(model, RoutingCounts)


def _verify(mtp_k, graphdef, state, cache, tokens, n_valid, rows, temperature, top_k, top_p, seed):
    """One verify window for every slot: tokens [S, k+1] = last token + drafts (n_valid[s] = 1 + drafts, 0 for
    idle slots). Returns (accepted drafts [S], emitted tokens [S, k+1], next drafts [S, mtp_k], cache rolled back
    to what was kept)."""
    model = nnx.merge(graphdef, state)
    logits, hidden, after, replays = model.verify(tokens, cache, n_valid, rows)
    n_drafts = jnp.maximum(n_valid - 1, 0)
    n_acc, out = accept(logits, tokens[:, 1:], n_drafts, temperature, top_k, top_p, seed, cache.lengths)
    n_keep = jnp.where(n_valid > 0, 1 + n_acc, 0)
    cache = rollback(cache, after, replays, n_keep)
    drafts = _no_drafts(tokens.shape[0])
    if mtp_k:
        # The kept positions' hidden states paired with the tokens that followed them: accepted drafts + bonus.
        drafts, cache = model.mtp_drafts(hidden, out, cache, n_keep, mtp_k)
    return n_acc, out, drafts, cache, nnx.state(model, RoutingCounts)


def on_weight_leaves(step, mtp_k: int, graphdef, treedef):
    """`step(mtp_k, graphdef, state, ...)` as a function of the weights' flat list of arrays. The host flattens
    a jitted function's arguments on every call: ~1400 nnx.State leaves of a 48-layer model cost ~3 ms per step on
    an H200's host (docs/PERF.md), a flat list a fraction of that."""

    def run(weights: list[jax.Array], *rest):
        return step(mtp_k, graphdef, jax.tree_util.tree_unflatten(treedef, weights), *rest)

    return run


def _reset(cache: ModelCache, slot):
    """Zeroes a slot's recurrent state and length (stale KV is harmless: positions past the length are masked)."""

    def zero(layer_field, x):
        if isinstance(layer_field, AttentionCache):
            return x
        return jax.lax.dynamic_update_slice_in_dim(x, jnp.zeros((1,) + x.shape[1:], x.dtype), slot, axis=0)

    layers = []
    for layer in cache.layers:
        mixer = layer.mixer
        if not isinstance(mixer, AttentionCache):
            mixer = jax.tree_util.tree_map(functools.partial(zero, mixer), mixer)
        ple = None if layer.ple is None else jax.tree_util.tree_map(functools.partial(zero, layer.ple), layer.ple)
        layers.append(layer.replace(mixer=mixer, ple=ple))
    cache = cache.replace(layers=tuple(layers), lengths=cache.lengths.at[slot].set(0))
    if cache.mtp_lengths is not None:
        cache = cache.replace(mtp_lengths=cache.mtp_lengths.at[slot].set(0))
    return cache


class DeviceSteps:
    """Owns the slot cache and the compiled functions that advance it.

    `warm_up` compiles every step function ahead of time, all at once on a thread pool (XLA compiles outside the
    GIL, so a 48-layer model's prefill, decode and verify compile side by side), and keeps the executables: from
    then on a call runs the executable compiled for its shapes. Before warm-up (tests) calls compile on first use.
    """

    def __init__(
        self, model: LoadedModel, config: EngineConfig, with_verify: bool = False,
        placement: PlacementConfig | None = None,
    ):
        """`placement`: the hot-expert placement policy (used when the model has a host expert tier)."""
        self.model = model
        self.placement = ExpertPlacement(model.state, model.graphdef, placement)
        self.placement.warm_up()
        self.config = config
        self.with_verify = with_verify or config.draft != "none"
        g = model.graphdef
        self._cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else model.dtype
        self.mtp_k = config.draft_k if config.draft == "mtp" else 0
        if self.mtp_k and not model.has_mtp:
            raise ValueError("draft='mtp' needs a checkpoint with MTP weights (mtp.*)")
        self.cache = self._new_cache()
        treedef = jax.tree_util.tree_structure(model.state)
        self._jitted = {
            name: jax.jit(on_weight_leaves(step, self.mtp_k, g, treedef), donate_argnums=(1,))
            for name, step in (("prefill", _prefill), ("decode", _decode), ("verify", _verify))
        }
        self._weight_leaves: list[jax.Array] | None = None
        self._compiled: dict[tuple[str, int], object] = {}
        self._reset = jax.jit(_reset, donate_argnums=(0,))
        self._read = jax.jit(take_slot)
        self._write = jax.jit(put_slot, donate_argnums=(0,))
        self.ple_dims = [model.config.ple_embed_dim] * len(model.config.ple_layers)

    def _rows(self, rows: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
        return tuple(jnp.asarray(r, self.model.dtype) for r in rows)

    def _weights(self) -> list[jax.Array]:
        """The model's weights as the flat list of arrays the step functions take. Flattened once: with a host
        expert tier every step, since placement rewrites pool arrays and counters in the State between steps."""
        if self.placement.active:
            return jax.tree_util.tree_leaves(self.model.state)
        if self._weight_leaves is None:
            self._weight_leaves = jax.tree_util.tree_leaves(self.model.state)
        return self._weight_leaves

    def _run(self, name: str, width: int, args: tuple):
        """Runs step `name` (window `width`) on the executable warm-up compiled, else through jit."""
        fn = self._compiled.get((name, width)) or self._jitted[name]
        *out, counts = fn(self._weights(), self.cache, *args)
        self.placement.store_counts(counts)  # routing counts stay on the device; no sync
        if name != "prefill":
            self.placement.tick()  # between steps: every N steps, may move hot experts into the pool
        return tuple(out)

    def _prefill_args(self, slot, tokens, n_valid, next_token, rows, sampling) -> tuple:
        temperature, top_k, top_p, seed = sampling
        return (
            jnp.int32(slot), jnp.asarray(tokens, jnp.int32), jnp.asarray([n_valid], jnp.int32),
            jnp.asarray([next_token], jnp.int32), self._rows(rows), jnp.asarray([temperature], jnp.float32),
            jnp.asarray([top_k], jnp.int32), jnp.asarray([top_p], jnp.float32), jnp.asarray([seed], jnp.uint32),
        )

    def _batch_args(self, tokens, mask, rows, sampling, mask_dtype) -> tuple:
        temperature, top_k, top_p, seed = sampling
        return (
            jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, mask_dtype), self._rows(rows),
            jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
            jnp.asarray(seed, jnp.uint32),
        )

    def prefill(
        self, slot: int, tokens: np.ndarray, n_valid: int, next_token: int, rows, sampling: tuple
    ) -> tuple[int, np.ndarray]:
        """Runs one prompt chunk (tokens [1, C]) of `slot`; returns the token sampled after its last real one and,
        with MTP drafting, the drafts that follow it. `next_token`: the prompt token after the chunk, or -1."""
        args = self._prefill_args(slot, tokens, n_valid, next_token, rows, sampling)
        token, drafts, self.cache = self._run("prefill", tokens.shape[1], args)
        return int(token), np.asarray(drafts)

    def decode(
        self, tokens: np.ndarray, active: np.ndarray, rows, sampling: tuple[np.ndarray, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        """One token for every slot (tokens/active [S]); returns the sampled tokens [S] and MTP drafts [S, k]."""
        out, drafts, self.cache = self._run("decode", 1, self._batch_args(tokens, active, rows, sampling, bool))
        return np.asarray(out), np.asarray(drafts)

    def decode_on_device(self, tokens, active: np.ndarray, sampling: tuple[np.ndarray, ...]) -> jax.Array:
        """`decode` for a model without PLE that leaves its result on the device: tokens [S] may be the device
        array a previous call returned. Returns the sampled tokens [S] as a device array (nothing is synced)."""
        out, _, self.cache = self._run("decode", 1, self._batch_args(tokens, active, (), sampling, bool))
        return out

    def verify(
        self, tokens: np.ndarray, n_valid: np.ndarray, rows, sampling: tuple[np.ndarray, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Checks every slot's drafts (tokens [S, k+1], n_valid [S]); returns (accepted counts, tokens [S, k+1],
        MTP drafts for the next step [S, k])."""
        args = self._batch_args(tokens, n_valid, rows, sampling, jnp.int32)
        n_acc, out, drafts, self.cache = self._run("verify", tokens.shape[1], args)
        return np.asarray(n_acc), np.asarray(out), np.asarray(drafts)

    def _new_cache(self) -> ModelCache:
        return init_cache(self.model.config, self.config.slots, self.config.max_context, self._cache_dtype,
                          with_mtp=bool(self.mtp_k))

    def recover(self) -> None:
        """A fresh, zeroed slot cache (after a failed step); every slot must be reset before reuse anyway."""
        self.cache = self._new_cache()

    def reset(self, slot: int) -> None:
        self.cache = self._reset(self.cache, jnp.int32(slot))

    def read(self, slot: int) -> ModelCache:
        """A host copy of one slot's state (batch dimension 1)."""
        return jax.tree_util.tree_map(np.asarray, self._read(self.cache, jnp.int32(slot)))

    def write(self, slot: int, sub: ModelCache) -> None:
        self.cache = self._write(self.cache, jnp.int32(slot), sub)

    def _warm_up_jobs(self) -> list[tuple[str, int, tuple]]:
        """(step, window, dummy arguments) for every shape traffic will use."""
        s, rows = self.config.slots, lambda b, t: tuple(np.zeros((b, t, d), np.float32) for d in self.ple_dims)
        z = np.zeros(s)
        batch_sampling = (z, z, z + 1, z)
        jobs = [
            ("prefill", c, self._prefill_args(0, np.zeros((1, c), np.int32), 1, -1, rows(1, c), (0.0, 0, 1.0, 0)))
            for c in self.config.prefill_chunks
        ]
        jobs.append(("decode", 1, self._batch_args(np.zeros(s, np.int32), np.zeros(s, bool), rows(s, 1),
                                                   batch_sampling, bool)))
        if self.with_verify:
            w = self.config.draft_k + 1
            jobs.append(("verify", w, self._batch_args(np.zeros((s, w), np.int32), np.zeros(s, np.int32),
                                                       rows(s, w), batch_sampling, jnp.int32)))
        return jobs

    def warm_up(self) -> float:
        """Compiles every step function ahead of time, in parallel; returns the seconds it took. Prints progress."""
        started = time.monotonic()
        jobs = self._warm_up_jobs()
        names = ", ".join(name if name == "decode" else f"{name}[{w}]" for name, w, _ in jobs)
        print(f"warm-up: compiling {len(jobs)} step functions in parallel ({names}) ...", file=sys.stderr, flush=True)

        def compile_one(job):
            name, width, args = job
            t0 = time.monotonic()
            compiled = self._jitted[name].lower(self._weights(), self.cache, *args).compile()
            print(f"warm-up: {name}[{width}] compiled in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
            return (name, width), compiled

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            self._compiled.update(pool.map(compile_one, jobs))
        if self.placement.active:  # the host experts' compiled shapes: up to every row a step can route to one expert
            t0 = time.monotonic()
            rows_max = max(self.config.slots * (self.config.draft_k + 1), *self.config.prefill_chunks)
            self.placement.layers[0].module.host.warm_up(rows_max)
            print(f"warm-up: host expert kernels (up to {rows_max} rows per expert) ready in "
                  f"{time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
        for name, width, args in jobs:  # one real run each: the first call of an executable has its own costs
            out = self._run(name, width, args)
            self.cache = out[-1]
        self.write(0, self.read(0))
        self.reset(0)
        jax.block_until_ready(self.cache)
        elapsed = time.monotonic() - started
        print(f"warm-up: {len(jobs) + 3} step functions ready in {elapsed:.1f}s", file=sys.stderr, flush=True)
        return elapsed
