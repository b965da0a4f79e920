"""`ModelRunner`: executes the engine's steps (strata_jax/engine/steps.py) on the device and owns the slot cache.

The runner only executes: the scheduler decides which step runs on which slots, and gets back each step's
outputs together with its routing counts (for the expert placement, which the runner knows nothing of).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.engine.config import EngineConfig
from strata_jax.engine.mesh import MeshSteps
from strata_jax.engine.speculative import window_inputs
from strata_jax.engine.steps import (
    STEPS, FlatWeights, Sampling, decode_args, greedy_sampling, jit_step, jit_step_donating_counts, prefill_args,
    put_slot, reset_slot, take_slot, take_slot_prefix, verify_args,
)
from strata_jax.model.cache import ModelCache, init_cache, kv_dtype_of, map_kv_positions
from strata_jax.model.config import ModelConfig


READ_MIN = 1024  # the smallest KV length `ModelRunner.read` copies for a prefix


def read_lengths(max_len: int) -> list[int]:
    """Every KV length a prefix read may copy, ascending: READ_MIN x 1, 1.5, 2, 3, 4, 6, ... (two per octave: a
    snapshot carries at most 1.5x its positions, ~1.2x on average, where powers of two alone carried up to 2x and
    ~1.4x; a 34K-token Claude Code first turn read 65,536 positions), then the whole cache. Each is compiled at
    warm-up."""
    lengths, octave = [], READ_MIN
    while octave < max_len:
        lengths += [octave, octave * 3 // 2]
        octave *= 2
    return sorted({min(n, max_len) for n in lengths} | {max_len})


def read_length(positions: int, max_len: int) -> int:
    """The KV length a prefix read of `positions` copies: the smallest of `read_lengths` that holds them."""
    return next((n for n in read_lengths(max_len) if n >= positions), max_len)


def put_slot_prefix(cache: ModelCache, slot: jax.Array, sub: ModelCache) -> ModelCache:
    """`cache` with slot `slot` replaced by `sub` (batch 1) whose attention KV covers only the first positions (a
    `read_length` bucket): the positions past them keep stale values, which the slot's length masks, as after
    `reset_slot`."""

    def put(x, y):
        return jax.lax.dynamic_update_slice(x, y.astype(x.dtype), (slot,) + (0,) * (x.ndim - 1))

    return jax.tree_util.tree_map(put, cache, sub)


def _device_int(x) -> jax.Array:
    """An int32 step output (already on the device) or a host array put there."""
    return x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x, np.int32))


def _kv_bytes(cache: ModelCache) -> int:
    total = 0

    def count(a, axis):
        nonlocal total
        total += a.nbytes
        return a

    map_kv_positions(cache, count)
    return total


@dataclasses.dataclass(frozen=True)
class RunnerModel:
    """What the runner needs of a model: its split graph and state, its config and dtype, whether it has MTP."""

    graphdef: nnx.GraphDef
    state: nnx.State
    config: ModelConfig
    dtype: Any  # of activations and (unless EngineConfig.cache_dtype says otherwise) caches, e.g. jnp.bfloat16
    has_mtp: bool = False
    mesh: Any = None  # a jax Mesh the state is placed on (strata_jax/engine/mesh.py); None: one device
    expert_exchange: str = "gather"  # over a mesh: how decode/verify move tokens to the experts

    @classmethod
    def of(cls, model) -> RunnerModel:
        """The runner's view of a `LoadedModel` (shares its state: weights written there are seen here)."""
        return cls(model.graphdef, model.state, model.config, model.dtype, model.has_mtp,
                   getattr(model, "mesh", None), getattr(model, "expert_exchange", "gather"))


@dataclasses.dataclass(frozen=True)
class PrefillOutput:
    """A prefill call's result for its P slots: the token sampled after each chunk's last real position [P]
    (meaningful after a prompt's last chunk), MTP drafts following it [P, mtp_k], and the step's routing counts
    (device arrays)."""

    tokens: np.ndarray
    drafts: np.ndarray
    counts: nnx.State
    logprobs: tuple | None = None  # (logprob [P], top ids [P, K], top logprobs [P, K]) on the device


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A decode or verify step's result for every slot: tokens [S] (decode; a device array from
    `decode_on_device`) or [S, k+1] (verify), MTP drafts for the next step [S, mtp_k], accepted drafts [S]
    (verify only) and the step's routing counts (device arrays: reading them syncs)."""

    tokens: np.ndarray | jax.Array
    drafts: np.ndarray | None
    counts: nnx.State
    accepted: np.ndarray | None = None
    logprobs: tuple | None = None  # (logprob [S(, k+1)], top ids [S(, k+1), K], top logprobs) on the device


def _step_name(name: str, width: int, batch: int) -> str:
    """How warm-up names a compiled step: decode, verify[5], prefill[2048], prefill[2048x4] (4 prompts at once)."""
    if name == "decode":
        return name
    return f"{name}[{width}x{batch}]" if name == "prefill" and batch > 1 else f"{name}[{width}]"


class ModelRunner:
    """Owns the slot cache and the compiled step functions that advance it.

    `warm_up` compiles every step function ahead of time, all at once on a thread pool (XLA compiles outside the
    GIL, so a 48-layer model's prefill, decode and verify compile side by side), and keeps the executables: from
    then on a call runs the executable compiled for its shapes. Before warm-up (tests) calls compile on first use.
    """

    def __init__(self, model: RunnerModel, config: EngineConfig, with_verify: bool = False,
                 counters_lock: contextlib.AbstractContextManager | None = None,
                 weights_version: Callable[[], int] | None = None):
        """`with_verify`: compile the verify step too (a drafter is used; implied by `config.draft`).
        `counters_lock`: held from a step's call until its routing counters are back in the model's state (the
        expert placement's lock: it reads them from other threads, and a step consumes the ones it is given).
        `weights_version`: a number that changes whenever something else rewrote weights in the model's state (the
        expert placement's `writes`); the runner re-reads the state when it has."""
        self.model = model
        self.config = config
        self.with_verify = with_verify or config.draft != "none"
        # int8 / fp8 quantize the attention K and V only; the other caches then stay in the model's dtype.
        self._kv_dtype = kv_dtype_of(config.cache_dtype)
        float_cache = config.cache_dtype and self._kv_dtype is None
        self._cache_dtype = jnp.dtype(config.cache_dtype) if float_cache else model.dtype
        self.mtp_k = config.draft_k if config.draft == "mtp" else 0
        if self.mtp_k and not model.has_mtp:
            raise ValueError("draft='mtp' needs a checkpoint with MTP weights (mtp.*)")
        # Over a mesh the steps are shard_maps and the cache is split by slot (strata_jax/engine/mesh.py).
        self.mesh_steps = None if model.mesh is None else MeshSteps(model.mesh, config.slots, model.expert_exchange)
        self.cache = self._new_cache()
        # Shapes are fixed at start: one slot's bytes, and the part of them that grows with positions (KV).
        self._slot_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.cache)) // config.slots
        self._slot_kv_bytes = _kv_bytes(self.cache) // config.slots
        # A host-tier model's routing counters: every step returns them advanced, and the next step counts on from
        # those. Donated where the steps run on one device, so that they keep their addresses (the step's CUDA
        # graphs are then not updated every step: docs/PERF.md, "Streamed experts").
        self._flat = FlatWeights(model.state, weights_version)
        self._counters_lock = counters_lock or contextlib.nullcontext()
        self.donates_counts = bool(self._flat.counter_at) and config.donate_counts and self.mesh_steps is None
        jit = jit_step_donating_counts if self.donates_counts else jit_step
        self._jitted = {name: jit(step, model.graphdef, model.state, self.mtp_k) for name, step in STEPS.items()}
        self._compiled: dict[tuple[str, int, int], object] = {}  # (step, window, batch) -> executable
        self._reset = jax.jit(reset_slot, donate_argnums=(0,))
        self._read = jax.jit(take_slot)
        self._read_prefix = jax.jit(take_slot_prefix, static_argnums=(2,))
        self._write = jax.jit(put_slot, donate_argnums=(0,))
        self._write_prefix = jax.jit(put_slot_prefix, donate_argnums=(0,))
        self.ple_dims = [model.config.ple_embed_dim] * len(model.config.ple_layers)
        if self.mesh_steps is not None:
            ms = self.mesh_steps
            self._jitted = {name: ms.jit_step(name, step, model.graphdef, model.state, self.mtp_k)
                            for name, step in STEPS.items()}
            self._reset, self._read, self._write = ms.reset_fn(), ms.read_fn(), ms.write_fn()
            self._read_prefix, self._write_prefix = ms.read_prefix_fn(), ms.write_fn()
        self.step_seconds: dict[tuple[str, int, int], float] = {}  # (step, width, batch) -> seconds, at warm-up
        self.mask_words = (model.config.vocab_size + 31) // 32
        self._free: dict[tuple, tuple[jax.Array, jax.Array]] = {}  # shape -> (all-allowing masks, no logprobs)
        self._uploads: dict[str, tuple[np.ndarray, jax.Array]] = {}  # input name -> (last values, their device copy)
        self._windows: dict[int, Callable] = {}  # id(drafter) -> its jitted `window_inputs` (chained windows)

    # -- weights -------------------------------------------------------------------------------------------------
    def _weights(self) -> list[jax.Array]:
        """The weights as the flat list of arrays the step functions take (re-read only after the state was
        rewritten: `steps.FlatWeights`)."""
        return self._flat.get()

    # -- steps ---------------------------------------------------------------------------------------------------
    def _run(self, name: str, width: int, batch: int, args: tuple) -> tuple:
        """Runs step `name` (window `width`, `batch` rows) on the executable warm-up compiled, else through jit;
        keeps the new cache and returns the other outputs."""
        fn = self._compiled.get((name, width, batch)) or self._jitted[name]
        if not self._flat.counter_at:
            *out, self.cache, counts = fn(self._weights(), self.cache, *args)
            return (*out, counts)
        with self._counters_lock:
            try:
                *out, self.cache, counts = fn(self._weights(), self.cache, *args)
            except Exception:
                self._flat.revive_counts()
                raise
            self._flat.put_counts(counts)
        return (*out, counts)

    def _unchanged_on_device(self, active: np.ndarray, sampling: Sampling) -> tuple[jax.Array, Sampling]:
        """A decode step's `active` mask and sampling arrays on the device, each re-uploaded only when its values
        changed since the last step (they change when a slot starts or ends, not from token to token): five fewer
        host-to-device copies per step, work the host otherwise repeats on the step loop, and inputs that keep
        their address (the step's CUDA graphs need no update for them)."""
        return self._kept("active", active, bool), self._kept_sampling(sampling)

    def _kept_sampling(self, sampling: Sampling) -> Sampling:
        names = ("temperature", "top_k", "top_p", "seed")
        dtypes = (np.float32, np.int32, np.float32, np.uint32)
        return tuple(self._kept(n, v, d) for n, v, d in zip(names, sampling, dtypes))

    def _kept(self, name: str, values, dtype) -> jax.Array:
        """`values` on the device: the last upload of input `name` while its values are the same."""
        values = np.asarray(values, dtype)
        last = self._uploads.get(name)
        if last is None or last[0].shape != values.shape or not np.array_equal(last[0], values):
            last = self._uploads[name] = (values.copy(), jax.device_put(values))  # no staging compile
        return last[1]

    def _extras(self, shape: tuple[int, ...], mask: np.ndarray | None, logprobs: np.ndarray | None) -> dict:
        """The steps' (mask, logprobs) inputs: the caller's, or device-resident ones that allow every token and ask
        for nothing (uploaded once per shape: an unconstrained step transfers no mask)."""
        if shape not in self._free:
            self._free[shape] = (jnp.full(shape + (self.mask_words,), -1, jnp.int32), jnp.zeros(shape[:1], bool))
        free_mask, no_logprobs = self._free[shape]
        return {"mask": free_mask if mask is None else mask, "logprobs": no_logprobs if logprobs is None else logprobs}

    def prefill(self, slots: Sequence[int], tokens: np.ndarray, n_valid: Sequence[int], next_tokens: Sequence[int],
                rows: Sequence[np.ndarray], sampling: Sampling, mask: np.ndarray | None = None,
                logprobs: np.ndarray | None = None) -> PrefillOutput:
        """Runs one prompt chunk for each of the distinct `slots` [P] at once (tokens [P, C], `n_valid` real ones
        per row). `next_tokens`: each prompt's token after its chunk, or -1. `sampling`: per-row arrays
        (temperature, top_k, top_p, seed), each [P]."""
        args = prefill_args(slots, tokens, n_valid, next_tokens, sampling, rows, self.model.dtype,
                            **self._extras((tokens.shape[0],), mask, logprobs))
        out, drafts, lp, counts = self._run("prefill", tokens.shape[1], tokens.shape[0], args)
        return PrefillOutput(np.asarray(out), np.asarray(drafts), counts, lp)

    def decode(self, tokens: np.ndarray, active: np.ndarray, rows: Sequence[np.ndarray],
               sampling: Sampling, mask: np.ndarray | None = None, logprobs: np.ndarray | None = None) -> StepOutput:
        """One token for every slot (tokens/active [S], sampling arrays [S]; grammar masks [S, W] and
        log-probability requests [S], None: none); results on the host (log-probabilities on the device)."""
        active, sampling = self._unchanged_on_device(active, sampling)
        args = decode_args(tokens, active, sampling, rows, self.model.dtype,
                           **self._extras((self.config.slots,), mask, logprobs))
        out, drafts, lp, counts = self._run("decode", 1, self.config.slots, args)
        return StepOutput(np.asarray(out), np.asarray(drafts), counts, logprobs=lp)

    def decode_on_device(self, tokens, active: np.ndarray, sampling: Sampling) -> StepOutput:
        """`decode` for a model without PLE that leaves its tokens on the device: `tokens` [S] may be the device
        array a previous call returned. Nothing is synced; the output's drafts are None."""
        active, sampling = self._unchanged_on_device(active, sampling)
        args = decode_args(tokens, active, sampling, (), self.model.dtype,
                           **self._extras((self.config.slots,), None, None))
        out, _, _, counts = self._run("decode", 1, self.config.slots, args)
        return StepOutput(out, None, counts)

    def verify(self, tokens: np.ndarray, n_valid: np.ndarray, rows: Sequence[np.ndarray],
               sampling: Sampling, mask: np.ndarray | None = None, logprobs: np.ndarray | None = None) -> StepOutput:
        """Checks every slot's drafts (tokens [S, k+1], n_valid [S]; grammar masks [S, k+1, W] and
        log-probability requests [S], None: none); results on the host (log-probabilities on the device)."""
        # Window lengths and sampling arrays repeat from window to window: uploaded only when they change.
        args = verify_args(tokens, self._kept("n_valid", n_valid, np.int32), self._kept_sampling(sampling), rows,
                           self.model.dtype, **self._extras(tokens.shape, mask, logprobs))
        n_acc, out, drafts, lp, counts = self._run("verify", tokens.shape[1], self.config.slots, args)
        n_acc, out, drafts = jax.device_get((n_acc, out, drafts))  # one wait for the three
        return StepOutput(np.asarray(out), np.asarray(drafts), counts, accepted=np.asarray(n_acc), logprobs=lp)

    def verify_on_device(self, tokens: jax.Array, n_valid: jax.Array, sampling: Sampling) -> StepOutput:
        """`verify` for a model without PLE, on windows built on the device (`window`), its outputs left there:
        nothing is synced (chained windows)."""
        args = verify_args(tokens, n_valid, self._kept_sampling(sampling), (), self.model.dtype,
                           **self._extras(tuple(tokens.shape), None, None))
        n_acc, out, drafts, _, counts = self._run("verify", tokens.shape[1], self.config.slots, args)
        return StepOutput(out, drafts, counts, accepted=n_acc)

    def window(self, drafter, out, accepted, lengths, step_drafts, want: np.ndarray, active: np.ndarray,
               width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The next chained verify window's (tokens [S, width], n_valid [S], lengths [S]) on the device, from the
        window before's outputs (`speculative.window_inputs`; host arrays for a chain's first window) and
        `drafter`'s guesses (a `DeviceDrafter`). `want`: each slot's most drafts; `active`: its slots in use."""
        fn = self._windows.get(id(drafter))
        if fn is None:
            fn = self._windows[id(drafter)] = jax.jit(functools.partial(window_inputs, drafter.device_drafts),
                                                      static_argnames=("width",))
        return fn(_device_int(out), _device_int(accepted), _device_int(lengths), _device_int(step_drafts),
                  self._kept("want", want, np.int32), self._kept("active", active, bool), drafter.device_state(),
                  width=width)

    def warm_up_windows(self, drafter) -> None:
        """Compiles `window` for every pair of (window before, next window) widths, a chain's first included."""
        s = self.config.slots
        for before in (1, *self.config.verify_widths):
            for width in self.config.verify_widths:
                self.window(drafter, np.zeros((s, before), np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32),
                            np.zeros((s, self.mtp_k), np.int32), np.zeros(s, np.int32), np.zeros(s, bool), width)

    # -- slots ---------------------------------------------------------------------------------------------------
    def _new_cache(self) -> ModelCache:
        cache = init_cache(self.model.config, self.config.slots, self.config.max_context, self._cache_dtype,
                           with_mtp=bool(self.mtp_k), kv_dtype=self._kv_dtype)
        return cache if self.mesh_steps is None else self.mesh_steps.place_cache(cache)

    def cache_lost(self) -> bool:
        """Whether the slot cache is unusable: a call that failed after the cache was donated to it deleted it."""
        return any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.cache))

    def recover(self) -> None:
        """A fresh, zeroed slot cache (after a failed step); every slot must be reset before reuse anyway."""
        self.cache = self._new_cache()

    def reset(self, slot: int) -> None:
        """Empties `slot` for a new sequence."""
        self.cache = self._reset(self.cache, jnp.int32(slot))

    def read(self, slot: int, upto: int | None = None) -> ModelCache:
        """A host copy of one slot's state (batch dimension 1). With `upto`, attention KV only for the first `upto`
        positions or a little more (`read_length`): a prefix snapshot needs no more, and copying a long context's
        whole KV to the host took seconds per snapshot."""
        length = self.cache.max_len if upto is None else read_length(upto, self.cache.max_len)
        if length >= self.cache.max_len:
            return jax.tree_util.tree_map(np.asarray, self._read(self.cache, jnp.int32(slot)))
        return jax.tree_util.tree_map(np.asarray, self._read_prefix(self.cache, jnp.int32(slot), length))

    def read_on_device(self, slot: int, upto: int) -> ModelCache:
        """`read(slot, upto)` left on the device: a copy of the slot's state (KV to `read_length(upto)`) queued
        behind the steps before it, returned at once. A prefix snapshot copies it to the host asynchronously; the
        slot's own buffers go on to the next step undisturbed."""
        length = read_length(upto, self.cache.max_len)
        if length >= self.cache.max_len:
            return self._read(self.cache, jnp.int32(slot))
        return self._read_prefix(self.cache, jnp.int32(slot), length)

    def snapshot_bytes(self, positions: int) -> int:
        """Host bytes of one slot's state with KV for `positions` positions (about what `read(slot, positions)`
        copies)."""
        kv, max_len = self._slot_kv_bytes, self.cache.max_len
        return self._slot_bytes - kv + kv * min(positions, max_len) // max_len

    def write(self, slot: int, sub: ModelCache) -> None:
        """Replaces one slot's state (batch dimension 1), e.g. with a prefix-cache snapshot. `sub`'s attention KV
        may cover the whole cache or only a `read_length` bucket of first positions (a restored prefix: only those
        cross to the device)."""
        if sub.max_len < self.cache.max_len:
            self.cache = self._write_prefix(self.cache, jnp.int32(slot), sub)
        else:
            self.cache = self._write(self.cache, jnp.int32(slot), sub)

    # -- compilation ---------------------------------------------------------------------------------------------
    def _warm_up_jobs(self) -> list[tuple[str, int, int, tuple]]:
        """(step, window, batch, dummy arguments) for every shape traffic will use."""
        s, dtype = self.config.slots, self.model.dtype
        rows = lambda b, t: tuple(np.zeros((b, t, d), np.float32) for d in self.ple_dims)  # noqa: E731
        jobs = [
            ("prefill", c, p, prefill_args(np.arange(p), np.zeros((p, c), np.int32), np.ones(p, np.int32),
                                           np.full(p, -1), greedy_sampling(p), rows(p, c), dtype,
                                           **self._extras((p,), None, None)))
            for c in self.config.prefill_chunks for p in self.config.prefill_batches
        ]
        jobs.append(("decode", 1, s, decode_args(np.zeros(s, np.int32), np.zeros(s, bool), greedy_sampling(s),
                                                 rows(s, 1), dtype, **self._extras((s,), None, None))))
        for w in self.config.verify_widths if self.with_verify else ():  # one per draft length (draft_policy.py)
            jobs.append(("verify", w, s, verify_args(np.zeros((s, w), np.int32), np.zeros(s, np.int32),
                                                     greedy_sampling(s), rows(s, w), dtype,
                                                     **self._extras((s, w), None, None))))
        return jobs

    def _time_steps(self, jobs: list[tuple[str, int, int, tuple]], runs: int = 2) -> None:
        """Times `runs` more runs of each prefill shape and of decode and keeps the fastest (`step_seconds`; one run
        alone can catch a busy host): the scheduler sizes the prefill it runs beside decoding slots from them
        (strata_jax/engine/prefill_policy.py)."""
        for name, width, batch, args in jobs:
            if name == "verify":
                continue
            for _ in range(runs):
                t0 = time.perf_counter()
                jax.block_until_ready(self._run(name, width, batch, args))
                took = time.perf_counter() - t0
                key = (name, width, batch)
                self.step_seconds[key] = min(took, self.step_seconds.get(key, took))

    def compiled_hlo(self) -> dict[str, str]:
        """Each compiled step's HLO text by its warm-up name (decode, prefill[4096], prefill[4096x4], ...): what
        `python -m strata_jax.bench.profile` needs to add a profile's kernels up per model part. {} before warm-up."""
        return {_step_name(name, w, b): compiled.as_text() for (name, w, b), compiled in self._compiled.items()}

    def largest_workspace_bytes(self) -> int | None:
        """The largest temporary allocation among the compiled steps (XLA's `memory_analysis()`), None before
        warm-up or where the backend does not report it: the memory a step needs beyond the persistent arrays."""
        sizes = []
        for compiled in self._compiled.values():
            try:
                sizes.append(int(compiled.memory_analysis().temp_size_in_bytes))
            except (AttributeError, NotImplementedError, RuntimeError, TypeError):
                continue
        return max(sizes) if sizes else None

    def warm_up(self, after_step: Callable[[str], None] | None = None) -> float:
        """Compiles every step function ahead of time, in parallel, then runs each once (the first call of an
        executable has its own costs). `after_step(name)` is called after each of those runs, as the owner calls
        it after every step. Returns the seconds it took; prints progress."""
        started = time.monotonic()
        jobs = self._warm_up_jobs()
        names = ", ".join(_step_name(name, w, b) for name, w, b, _ in jobs)
        print(f"warm-up: compiling {len(jobs)} step functions in parallel ({names}) ...", file=sys.stderr, flush=True)

        def compile_one(job):
            name, width, batch, args = job
            t0 = time.monotonic()
            compiled = self._jitted[name].lower(self._weights(), self.cache, *args).compile()
            print(f"warm-up: {_step_name(name, width, batch)} compiled in {time.monotonic() - t0:.1f}s",
                  file=sys.stderr, flush=True)
            return (name, width, batch), compiled

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            self._compiled.update(pool.map(compile_one, jobs))
        for name, width, batch, args in jobs:
            self._run(name, width, batch, args)
            if after_step is not None:
                after_step(name)
        self._time_steps(jobs)
        rate = lambda n, w, b, t: f" ({w * b / t:,.0f} tok/s)" if n == "prefill" else ""  # noqa: E731
        timed = ", ".join(f"{_step_name(n, w, b)} {t * 1e3:.0f} ms{rate(n, w, b, t)}"
                          for (n, w, b), t in self.step_seconds.items())
        print(f"warm-up: a call of each (the faster of two): {timed}", file=sys.stderr, flush=True)
        self.write(0, self.read(0))
        for length in read_lengths(self.cache.max_len)[:-1]:  # snapshots' prefix reads and writes: compiled now
            self.write(0, self.read(0, length))
        for slot in range(max(self.config.prefill_batches)):
            self.reset(slot)
        jax.block_until_ready(self.cache)
        elapsed = time.monotonic() - started
        print(f"warm-up: {len(jobs) + 3} step functions ready in {elapsed:.1f}s", file=sys.stderr, flush=True)
        return elapsed
