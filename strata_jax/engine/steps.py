"""The engine's step functions: pure, fixed-shape functions of (model, slot cache, inputs) that the model runner
jits with the cache donated, and the public pieces benchmarks build the same compiled steps from.

- `prefill_step`: one chunk of the prompts of P slots at once (batch P, chunk size C; a prompt's last chunk is
  masked by `n_valid`), sampling each row's next token from its last real position;
- `decode_step`: one token for every slot at once, inactive slots masked (their state does not move);
- `verify_step`: one speculative window for every slot (last token + drafts), rolled back to what was accepted;
- `reset_slot` / `take_slot` / `put_slot`: a slot's state, for new requests and prefix-cache snapshots.
Every step also returns the routing counts (`RoutingCounts` state) its MoE layers accumulated. Slot indices are
traced values: one compilation serves every slot.

Constrained decoding and log-probabilities: every step optionally takes `mask` (packed int32 token masks, one per
row and window position, `constraints.py`; a row of -1 words allows everything) and `logprobs` (bool per row: the
row asked for log-probabilities). Without them (None, the benchmarks' calls) the step is the plain one; with them
it unpacks masks only when some row is constrained and computes the top-`MAX_TOP_LOGPROBS` log-probabilities only
when some row asked (`lax.cond`), and returns them after the tokens: (logprob, top ids, top logprobs) per row and
position (zeros where nobody asked).

Benchmarks: `jit_step(decode_step, graphdef, state)` is the engine's compiled decode over `flat_weights(state)`;
`decode_args` / `verify_args` build its inputs; `.lower(weights, cache, *args)` on it gives the HLO.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.engine.protocol import MAX_TOP_LOGPROBS
from strata_jax.engine.sampling import apply_token_mask, sample, token_logprobs
from strata_jax.engine.speculative import accept
from strata_jax.model.cache import AttentionCache, ModelCache, map_kv_positions, put_rows, take_rows
from strata_jax.model.decoder import rollback
from strata_jax.model.moe import RoutingCounts

# Per-slot sampling parameters: (temperature, top_k, top_p, seed), each a scalar or an [S] array.
Sampling = tuple


def take_slot(cache: ModelCache, slot: jax.Array) -> ModelCache:
    """One slot's state (batch dimension 1)."""
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), cache)


def take_slots(cache: ModelCache, slots: jax.Array) -> ModelCache:
    """The states of `slots` [P] (distinct), stacked in that order (batch dimension P)."""
    return take_rows(cache, slots)


def put_slots(cache: ModelCache, slots: jax.Array, sub: ModelCache) -> ModelCache:
    """`cache` with slots `slots` [P] (distinct) replaced by the P rows of `sub`."""
    return put_rows(cache, slots, sub)


def take_slot_prefix(cache: ModelCache, slot: jax.Array, length: int) -> ModelCache:
    """One slot's state (batch dimension 1) with attention KV cut to its first `length` positions (static)."""
    return map_kv_positions(take_slot(cache, slot), lambda x, axis: jax.lax.slice_in_dim(x, 0, length, axis=axis))


def put_slot(cache: ModelCache, slot: jax.Array, sub: ModelCache) -> ModelCache:
    """`cache` with slot `slot` replaced by `sub` (batch dimension 1)."""
    return jax.tree_util.tree_map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, slot, axis=0), cache, sub)


def reset_slot(cache: ModelCache, slot: jax.Array) -> ModelCache:
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


def _no_drafts(batch: int) -> jax.Array:
    return jnp.zeros((batch, 0), jnp.int32)


def _masked(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """`logits` with the grammar masks applied (unpacked only when some row's mask forbids a token)."""
    if mask is None:
        return logits
    return apply_token_mask(logits, mask, jnp.any(mask != -1))


def _logprobs(logits: jax.Array, tokens: jax.Array, wanted: jax.Array | None) -> tuple:
    """The step's log-probability outputs (none when the caller passed no `logprobs` input)."""
    if wanted is None:
        return ()
    return (token_logprobs(logits, tokens, MAX_TOP_LOGPROBS, jnp.any(wanted)),)


def held(x: jax.Array) -> jax.Array:
    """A non-negative int32 step input (`n_valid`, prefill's `slots`) copied into the step's own memory, for the
    layers to read.

    XLA runs a step as CUDA graphs whose commands hold buffer addresses, and updates every command reading a
    buffer that moved since the last call. An input uploaded for each call moves every call; read by every layer
    (the window lengths are), it would have most of the graph updated each step, as a moving scratch buffer did
    (docs/PERF.md, "Engine decode step"). The copy lives in the step's scratch memory, kept at one address under
    `--command-buffers stable-scratch`, so only the copying command reads the input. The copy is a reduction
    (the maximum of `x` and 0, values unchanged): XLA fuses elementwise copies into their readers, which would
    read the input again, and an optimization barrier is gone before fusion, but it does not fuse a reduction
    into its readers."""
    return jnp.stack([x, jnp.zeros_like(x)]).max(axis=0)


def prefill_step(mtp_k, graphdef, state, cache, slots, tokens, n_valid, next_token, rows, temperature, top_k,
                 top_p, seed, mask=None, logprobs=None):
    """One prompt chunk for each of P distinct slots `slots` [P] at once: tokens [P, C], of which row p's first
    `n_valid[p]` are real (a row with none leaves its slot as it was).

    `next_token` [P] is each prompt's token after its chunk (-1 after the last chunk: then the sampled token
    follows). Sampling parameters are per row ([P]). With MTP drafting (mtp_k > 0) the chunk's pairs enter the MTP
    cache and the returned drafts guess the tokens after the sampled one. Logits are computed for each row's last
    real position only: the whole chunk's would cost C x vocabulary x hidden flops and C x vocabulary floats.
    `mask` [P, W] / `logprobs` [P]: see the module doc. Returns (tokens [P], drafts [P, mtp_k], (log-probabilities,
    with `logprobs`), cache, routing counts).

    The slots' rows are updated in place in the (donated) cache, one layer at a time (`TextModel`'s `cache_rows`):
    no copy of the slots' whole cache is made (at 4 slots x 262,144 int8 that copy was 4.09 GiB per prompt)."""
    model = nnx.merge(graphdef, state)
    slots, n_valid = held(slots), held(n_valid)
    lengths = take_rows(cache.lengths, slots) + n_valid  # each row's length after its chunk
    hidden, cache = model.model(tokens, cache, n_valid, rows, cache_rows=slots)
    last = jnp.maximum(n_valid - 1, 0)[:, None, None]
    logits = model.logits(jnp.take_along_axis(hidden, last, axis=1))[:, 0]  # [P, V]
    token = sample(_masked(logits, mask), temperature, top_k, top_p, seed, lengths)
    drafts = _no_drafts(tokens.shape[0])
    if mtp_k:
        follow = jnp.where(next_token >= 0, next_token, token)  # [P]
        shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        at_last = jnp.arange(tokens.shape[1])[None] == (n_valid - 1)[:, None]
        nxt = jnp.where(at_last, follow[:, None], shifted)
        # The MTP head reads and writes only the MTP layer: its rows alone are taken (one layer, like the model's),
        # after the model (the barrier: not hoisted to the start, beside every other layer's rows).
        hidden, mtp = jax.lax.optimization_barrier((hidden, cache.mtp))
        sub = ModelCache(layers=(), lengths=lengths, mtp=take_rows(mtp, slots),
                         mtp_lengths=take_rows(cache.mtp_lengths, slots))
        drafts, sub = model.mtp_drafts(hidden, nxt, sub, n_valid, mtp_k)
        cache = cache.replace(mtp=put_rows(cache.mtp, slots, sub.mtp),
                              mtp_lengths=put_rows(cache.mtp_lengths, slots, sub.mtp_lengths))
    return (token, drafts, *_logprobs(logits, token, logprobs), cache, nnx.state(model, RoutingCounts))


def decode_step(mtp_k, graphdef, state, cache, tokens, active, rows, temperature, top_k, top_p, seed, mask=None,
                logprobs=None):
    """One token for every slot (tokens, active [S]; `mask` [S, W], `logprobs` [S]: see the module doc). Returns
    (tokens [S], MTP drafts [S, mtp_k], (log-probabilities, with `logprobs`), cache, routing counts)."""
    model = nnx.merge(graphdef, state)
    n_valid = active.astype(jnp.int32)
    logits, hidden, cache = model(tokens[:, None], cache, n_valid, rows)
    out = sample(_masked(logits[:, 0], mask), temperature, top_k, top_p, seed, cache.lengths)
    drafts = _no_drafts(tokens.shape[0])
    if mtp_k:
        drafts, cache = model.mtp_drafts(hidden, out[:, None], cache, n_valid, mtp_k)
    return (out, drafts, *_logprobs(logits[:, 0], out, logprobs), cache, nnx.state(model, RoutingCounts))


def verify_step(mtp_k, graphdef, state, cache, tokens, n_valid, rows, temperature, top_k, top_p, seed, mask=None,
                logprobs=None):
    """One verify window for every slot: tokens [S, k+1] = last token + drafts (n_valid[s] = 1 + drafts, 0 for
    idle slots); `mask` [S, k+1, W] (the grammar's mask at each window position; drafts it forbids are rejected),
    `logprobs` [S]. Returns (accepted drafts [S], emitted tokens [S, k+1], next drafts [S, mtp_k],
    (log-probabilities [S, k+1, ...], with `logprobs`), cache rolled back to what was kept, routing counts)."""
    model = nnx.merge(graphdef, state)
    n_valid = held(n_valid)
    logits, hidden, after, replays = model.verify(tokens, cache, n_valid, rows)
    n_drafts = jnp.maximum(n_valid - 1, 0)
    n_acc, out = accept(_masked(logits, mask), tokens[:, 1:], n_drafts, temperature, top_k, top_p, seed,
                        cache.lengths)
    n_keep = jnp.where(n_valid > 0, 1 + n_acc, 0)
    cache = rollback(cache, after, replays, n_keep)
    drafts = _no_drafts(tokens.shape[0])
    if mtp_k:
        # The kept positions' hidden states paired with the tokens that followed them: accepted drafts + bonus.
        drafts, cache = model.mtp_drafts(hidden, out, cache, n_keep, mtp_k)
    return n_acc, out, drafts, *_logprobs(logits, out, logprobs), cache, nnx.state(model, RoutingCounts)


STEPS: dict[str, Callable] = {"prefill": prefill_step, "decode": decode_step, "verify": verify_step}


def flat_weights(state: nnx.State) -> list[jax.Array]:
    """The model's weights as the flat list of arrays `jit_step` functions take."""
    return jax.tree_util.tree_leaves(state)


def jit_step(step: Callable, graphdef, state: nnx.State, mtp_k: int = 0, flat: bool = True):
    """`step` (one of `STEPS`) jitted as the engine runs it: a function of (weights, cache, *inputs) with the
    cache donated, returning the step's outputs. `weights` is `flat_weights(state)` (flat=True) or the nnx.State
    itself (flat=False). The host flattens a jitted function's arguments on every call: ~1400 nnx.State leaves of a
    48-layer model cost ~3 ms per step on an H200's host (docs/PERF.md), a flat list a fraction of that."""
    if not flat:
        return jax.jit(functools.partial(step, mtp_k, graphdef), donate_argnums=(1,))
    return jax.jit(_on_flat_weights(step, graphdef, state, mtp_k), donate_argnums=(1,))


def _on_flat_weights(step: Callable, graphdef, state: nnx.State, mtp_k: int) -> Callable:
    """`step` as a function of (flat weights, *rest): the state rebuilt from `flat_weights(state)`'s order."""
    treedef = jax.tree_util.tree_structure(state)

    def run(weights: list[jax.Array], *rest):
        return step(mtp_k, graphdef, jax.tree_util.tree_unflatten(treedef, weights), *rest)

    return run


def state_variables(state: nnx.State) -> list:
    """The Variables of `state` (nnx.Variable, or flax 0.10's VariableState) in `flat_weights(state)`'s order."""

    def is_variable(x) -> bool:  # an nnx.Variable (flax >= 0.11) or a VariableState (its `.type`, flax 0.10)
        return isinstance(x, nnx.Variable) or isinstance(getattr(x, "type", None), type)

    variables = jax.tree_util.tree_leaves(state, is_leaf=is_variable)
    if len(variables) != len(flat_weights(state)):
        raise ValueError("the state's variables and its leaves do not line up")
    return variables


def counter_mask(state: nnx.State) -> list[bool]:
    """Per leaf of `flat_weights(state)`: whether it is a counter the step returns updated (`RoutingCounts`)."""
    kinds = [getattr(v, "type", None) if isinstance(getattr(v, "type", None), type) else type(v)
             for v in state_variables(state)]
    return [issubclass(k, RoutingCounts) for k in kinds]


class FlatWeights:
    """The weights as the flat list of arrays the step functions take (`flat_weights(state)`), flattened again only
    when `version()` changes (something rewrote the state: the expert placement's `writes`) or after `invalidate`.
    A step returns the routing counters the next one counts on from: `put_counts` puts them into the list and into
    the state's Variables (where the placement reads them), so nothing is flattened between placement rounds."""

    def __init__(self, state: nnx.State, version: Callable[[], int] | None = None):
        mask = counter_mask(state)
        self.counter_at = [i for i, c in enumerate(mask) if c]
        self.counter_vars = [v for v, c in zip(state_variables(state), mask) if c]
        self._state = state
        self._version = version or (lambda: 0)
        self._seen: int | None = None
        self._leaves: list[jax.Array] | None = None

    def get(self) -> list[jax.Array]:
        """The current list (the same object between re-reads: `put_counts` writes into it)."""
        version = self._version()
        if self._leaves is None or version != self._seen:
            self._seen, self._leaves = version, flat_weights(self._state)
        return self._leaves

    def invalidate(self) -> None:
        """The state was rewritten by something `version` does not count: re-read it on the next `get`."""
        self._leaves = None

    def put_counts(self, counts: nnx.State) -> None:
        """Puts a step's returned counters in place of the ones it was given (and consumed, where donated)."""
        leaves = self.get()
        for i, var, a in zip(self.counter_at, self.counter_vars, jax.tree_util.tree_leaves(counts)):
            leaves[i] = a
            var.set_value(a)

    def revive_counts(self) -> None:
        """After a failed call that consumed the counters: zeroed ones in their place (the counts since the last
        placement round are lost with the step)."""
        leaves = self.get()
        for i, var in zip(self.counter_at, self.counter_vars):
            if leaves[i].is_deleted():
                leaves[i] = zeros = jnp.zeros(leaves[i].shape, leaves[i].dtype)
                var.set_value(zeros)


class CountersDonated:
    """A step jitted with the routing counters donated besides the cache (`jit_step_donating_counts`), called as
    the engine calls any step: (weights, cache, *inputs), `weights` the flat list with the counters in it. Their
    arrays are consumed: the caller must put the returned counters back before the next call. `.lower(...)` and
    `.compile()` keep that calling form."""

    def __init__(self, fn, keep: list[int], counters: list[int]):
        self.fn, self.keep, self.counters = fn, keep, counters

    def _split(self, weights: Sequence[jax.Array]) -> tuple[list, list]:
        return [weights[i] for i in self.keep], [weights[i] for i in self.counters]

    def __call__(self, weights, *rest):
        return self.fn(*self._split(weights), *rest)

    def lower(self, weights, *rest) -> CountersDonated:
        return CountersDonated(self.fn.lower(*self._split(weights), *rest), self.keep, self.counters)

    def compile(self) -> CountersDonated:
        return CountersDonated(self.fn.compile(), self.keep, self.counters)

    def as_text(self) -> str:
        return self.fn.as_text()

    def memory_analysis(self):
        return self.fn.memory_analysis()


def jit_step_donating_counts(step: Callable, graphdef, state: nnx.State, mtp_k: int = 0) -> CountersDonated:
    """`jit_step` (flat weights) with the routing counters donated as well as the cache: their outputs then reuse
    the inputs' buffers, so every step writes them at the same addresses. A CUDA graph is updated when a buffer it
    touches moves: with 96 counter outputs moving every step, the streamed Flash-Next step spent 5.0 ms of host time
    per step updating its graphs, 0.9 ms with them donated (docs/PERF.md, "Streamed experts")."""
    on_flat = _on_flat_weights(step, graphdef, state, mtp_k)
    mask = counter_mask(state)
    keep = [i for i, c in enumerate(mask) if not c]
    counters = [i for i, c in enumerate(mask) if c]

    def run(fixed: list[jax.Array], counts: list[jax.Array], *rest):
        weights = [None] * len(mask)
        for i, a in zip(keep + counters, fixed + counts):
            weights[i] = a
        return on_flat(weights, *rest)

    return CountersDonated(jax.jit(run, donate_argnums=(1, 2)), keep, counters)


def greedy_sampling(slots: int) -> Sampling:
    """Sampling parameters of `slots` greedy slots (temperature 0, no top-k/top-p, seed 0)."""
    z = np.zeros(slots)
    return (z, z, z + 1, z)


def _on_device(x, dtype) -> jax.Array:
    """`x` as a device array of `dtype`. A host array is converted on the host and put on the device: `jnp.asarray`
    of a numpy array compiles a small staging function at each new shape and dtype, on the engine thread at a
    shape's first step (~20-30 ms each on the CPU)."""
    if isinstance(x, jax.Array):
        return x if x.dtype == dtype else x.astype(dtype)
    return jax.device_put(np.asarray(x, dtype))


def _rows(rows: Sequence[np.ndarray], dtype) -> tuple[jax.Array, ...]:
    return tuple(_on_device(r, dtype) for r in rows)


def _sampling(sampling: Sampling) -> tuple[jax.Array, ...]:
    temperature, top_k, top_p, seed = sampling
    return (_on_device(temperature, jnp.float32), _on_device(top_k, jnp.int32), _on_device(top_p, jnp.float32),
            _on_device(seed, jnp.uint32))


def _extras(mask, logprobs) -> tuple:
    """The optional (mask, logprobs) inputs: both or neither (a host array or one already on the device)."""
    if mask is None and logprobs is None:
        return ()
    return (_on_device(mask, jnp.int32), _on_device(logprobs, bool))


def prefill_args(slots, tokens, n_valid, next_token, sampling: Sampling, rows=(), row_dtype=jnp.float32, mask=None,
                 logprobs=None) -> tuple:
    """`prefill_step`'s inputs after the cache: chunks tokens [P, C] of slots [P], their real lengths and following
    tokens [P], per-row sampling arrays [P], PLE rows (one array [P, C, D] per PLE layer); optionally token masks
    [P, W] and log-probability requests [P] (both or neither)."""
    return (_on_device(slots, jnp.int32), _on_device(tokens, jnp.int32), _on_device(n_valid, jnp.int32),
            _on_device(next_token, jnp.int32), _rows(rows, row_dtype), *_sampling(sampling),
            *_extras(mask, logprobs))


def decode_args(tokens, active, sampling: Sampling, rows=(), row_dtype=jnp.float32, mask=None,
                logprobs=None) -> tuple:
    """`decode_step`'s inputs after the cache: tokens [S] (host or device array), active [S] bool, per-slot
    sampling arrays [S], PLE rows (one array [S, 1, D] per PLE layer); optionally token masks [S, W] and
    log-probability requests [S] (both or neither)."""
    return (_on_device(tokens, jnp.int32), _on_device(active, bool), _rows(rows, row_dtype), *_sampling(sampling),
            *_extras(mask, logprobs))


def verify_args(tokens, n_valid, sampling: Sampling, rows=(), row_dtype=jnp.float32, mask=None,
                logprobs=None) -> tuple:
    """`verify_step`'s inputs after the cache: windows tokens [S, k+1], n_valid [S], per-slot sampling arrays [S],
    PLE rows (one array [S, k+1, D] per PLE layer); optionally token masks [S, k+1, W] and log-probability requests
    [S] (both or neither)."""
    return (_on_device(tokens, jnp.int32), _on_device(n_valid, jnp.int32), _rows(rows, row_dtype),
            *_sampling(sampling), *_extras(mask, logprobs))
