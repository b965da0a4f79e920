"""`load_model`: a checkpoint on disk -> an object that computes logits and generates, for one caller.

The model is split once into (graphdef, state); every call runs a jitted pure function
`step(state, tokens, cache, n_valid, ple_rows) -> (logits, hidden, cache)` with the cache donated.
The PLE n-gram rows are gathered on the host before each call.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from strata_jax.host.pool import HostPool
from strata_jax.host.tier import HostTier
from strata_jax.model.config import ExpertQuantization, ModelConfig, load_config
from strata_jax.model.cache import ModelCache, init_cache
from strata_jax.model.decoder import CausalLM, enable_fused_decode
from strata_jax.model.expert_parallel import replicated_call, shard_state
from strata_jax.model.ple_hash import NgramHasher, PleTable
from strata_jax.weights.convert import is_converted, read_marker, restore_params
from strata_jax.weights.loader import fill_params, has_mtp, load_ple_tables
from strata_jax.weights.safetensors_io import CheckpointReader

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Sequences:
    """State of a batch of sequences: the device cache and, per PLE layer, the host-side n-gram context."""

    cache: ModelCache
    ple_context: list[np.ndarray]


def _step(graphdef, state, tokens, cache, n_valid, ple_rows):
    model = nnx.merge(graphdef, state)
    return model(tokens, cache, n_valid, ple_rows)


def _mtp_step(graphdef, state, next_tokens, hidden, cache, n_valid):
    model = nnx.merge(graphdef, state)
    return model.mtp_logits(next_tokens, hidden, cache, n_valid)


class LoadedModel:
    """A loaded checkpoint. See `load_model`. `host_pool`: the pool its MoE layers' host tiers compute on (a new,
    idle one for a model without any), where the CLI and the benchmarks read `busy()` and switch kernels."""

    def __init__(self, path: Path, config: ModelConfig, model: CausalLM, dtype, ple_tables: list[PleTable], tokenizer,
                 host_pool: HostPool | None = None, mesh: Mesh | None = None, expert_exchange: str = "gather",
                 ple_hashers: list[NgramHasher] | None = None):
        self.path = path
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.host_pool = host_pool if host_pool is not None else HostPool()
        self.has_mtp = model.mtp is not None
        self._graphdef, self._state = nnx.split(model)
        self._ple_tables = ple_tables
        self._hashers = (ple_hashers if ple_hashers is not None  # a GGUF stores its hash constants
                         else [NgramHasher.for_layer(config, i) for i in range(len(config.ple_layers))])
        self.gguf_report = None  # set by load_model for a GGUF file (strata_jax.weights.gguf_loader.GGUFReport)
        for hasher, table in zip(self._hashers, ple_tables):
            if table.rows < hasher.table_rows - config.ngram_vocab_divisor:
                raise ValueError(f"PLE table has {table.rows} rows, the hash needs {hasher.table_rows}")
        self._step = jax.jit(functools.partial(_step, self._graphdef), donate_argnums=(2,))
        self._mtp_step = jax.jit(functools.partial(_mtp_step, self._graphdef), donate_argnums=(3,))
        # Over a mesh (strata_jax/model/expert_parallel.py): experts split, the rest replicated, every step a
        # shard_map whose MoE layers sum their devices' experts. The engine's runner shards its own steps by slot.
        self.mesh = mesh
        self.expert_exchange = expert_exchange
        if mesh is not None:
            shard_state(self._state, mesh)
            self._step = jax.jit(functools.partial(replicated_call, _step, self._graphdef, mesh, expert_exchange),
                                 donate_argnums=(2,))
            self._mtp_step = jax.jit(functools.partial(replicated_call, _mtp_step, self._graphdef, mesh,
                                                       expert_exchange), donate_argnums=(3,))

    # -- pieces the serving engine builds its own jitted steps from ------------------------------------------
    @property
    def graphdef(self):
        return self._graphdef

    @property
    def state(self):
        return self._state

    def ple_context(self, tokens: list[int] | np.ndarray) -> list[np.ndarray]:
        """Per PLE layer, the host n-gram context [1, ngram_size-1] after having consumed `tokens`."""
        out = []
        for h in self._hashers:
            ctx = h.initial_context(1)
            if len(tokens):
                ctx = h.next_context(ctx, np.asarray([tokens], np.int64))
            out.append(ctx)
        return out

    def ple_inputs(
        self, contexts: list[np.ndarray], tokens: np.ndarray, n_valid: np.ndarray | None = None
    ) -> tuple[tuple[np.ndarray, ...], list[np.ndarray]]:
        """Host-side PLE rows for tokens [B, T] (one [B, T, ple_dim] array per PLE layer) and the new contexts."""
        rows, new = [], []
        for hasher, table, ctx in zip(self._hashers, self._ple_tables, contexts):
            rows.append(table.gather(hasher.row_ids(ctx, tokens), np.float32))
            new.append(hasher.next_context(ctx, tokens, n_valid))
        return tuple(rows), new

    def ple_next_context(self, contexts: list[np.ndarray], tokens: np.ndarray, n_valid: np.ndarray) -> list[np.ndarray]:
        """The contexts after consuming the first n_valid[b] of tokens [B, T] (no rows gathered)."""
        return [h.next_context(ctx, tokens, n_valid) for h, ctx in zip(self._hashers, contexts)]

    # -- low-level, explicit-state API -------------------------------------------------------------------------
    def start(self, batch: int, max_len: int) -> Sequences:
        """Empty state for `batch` sequences of up to `max_len` tokens."""
        cache = init_cache(self.config, batch, max_len, self.dtype, with_mtp=self.has_mtp)
        return Sequences(cache, [h.initial_context(batch) for h in self._hashers])

    def step(
        self, seqs: Sequences, tokens: np.ndarray, n_valid: np.ndarray | None = None
    ) -> tuple[np.ndarray, jax.Array, Sequences]:
        """Feeds tokens [B, T] (row b's first n_valid[b] real) -> (logits [B, T, V] float32, hidden, new state).

        The old `seqs` must not be used again (its device buffers are donated)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        b, t = tokens.shape
        n_valid = np.full((b,), t, np.int32) if n_valid is None else np.asarray(n_valid, np.int32)
        if int(np.max(seqs_lengths(seqs) + n_valid)) > seqs.cache.max_len:
            raise ValueError(f"sequence longer than the cache ({seqs.cache.max_len} tokens)")
        rows, contexts = self.ple_inputs(seqs.ple_context, tokens, n_valid)
        rows = tuple(jnp.asarray(r, self.dtype) for r in rows)
        logits, hidden, cache = self._step(self._state, jnp.asarray(tokens), seqs.cache, jnp.asarray(n_valid), rows)
        return np.asarray(logits), hidden, Sequences(cache, contexts)

    def mtp_step(
        self, seqs: Sequences, next_tokens: np.ndarray, hidden: jax.Array, n_valid: np.ndarray | None = None
    ) -> tuple[np.ndarray, Sequences]:
        """MTP logits [B, T, V] from main-model hidden states [B, T, H] and the tokens that follow them."""
        next_tokens = np.asarray(next_tokens, np.int32)
        b, t = next_tokens.shape
        n_valid = np.full((b,), t, np.int32) if n_valid is None else np.asarray(n_valid, np.int32)
        logits, cache = self._mtp_step(self._state, jnp.asarray(next_tokens), hidden, seqs.cache, jnp.asarray(n_valid))
        return np.asarray(logits), Sequences(cache, seqs.ple_context)

    # -- the stable contract ----------------------------------------------------------------------------------
    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits float32 [B, T, V] for token ids [B, T], each row an independent sequence from position 0."""
        ids = np.asarray(ids, np.int32)
        if ids.ndim != 2:
            raise ValueError(f"ids must be [batch, tokens], got shape {ids.shape}")
        logits, _, _ = self.step(self.start(ids.shape[0], ids.shape[1]), ids)
        return logits

    def generate(
        self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0, stop_at_eos: bool = True
    ) -> list[int]:
        """Continues `ids` by up to `max_new_tokens` tokens (greedy at temperature 0); with `stop_at_eos`, stops
        after the first eos token (the config's and the tokenizer's)."""
        if not ids:
            raise ValueError("generate needs at least one prompt token")
        seqs = self.start(1, len(ids) + max_new_tokens)
        logits, _, seqs = self.step(seqs, np.asarray([ids], np.int32))
        rng = np.random.default_rng(seed)
        eos = set(self.config.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        if not stop_at_eos:
            eos = set()
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = _sample(logits[0, -1], temperature, rng)
            out.append(token)
            if token in eos:
                break
            logits, _, seqs = self.step(seqs, np.asarray([[token]], np.int32))
        return out


def seqs_lengths(seqs: Sequences) -> np.ndarray:
    return np.asarray(seqs.cache.lengths)


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def host_kernel_beside(mesh: Mesh | None, host_kernel: str) -> str:
    """The host experts' kernel to use beside `mesh`: "numpy" instead of "xla" when the mesh is several XLA:CPU
    devices (forced host devices). The step of such a mesh holds XLA:CPU's threads while its devices wait for each
    other in a collective, and the xla host kernel, called from inside that step, needs one of those threads: on 4
    devices and 2 cores the step deadlocked (jaxlib 0.10.2 hung, 0.11.2 aborted in its rendezvous, 2026-12-02)."""
    if host_kernel != "xla" or mesh is None or mesh.devices.size < 2:
        return host_kernel
    if any(d.platform != "cpu" for d in mesh.devices.flat):
        return host_kernel
    print(f"note: host experts use the numpy kernel: the xla kernel would wait on the XLA:CPU threads that a mesh of "
          f"{mesh.devices.size} CPU devices holds in its collectives", file=sys.stderr)
    return "numpy"


def load_model(
    path: str | Path,
    dtype: str = "float32",
    quantize: str | None = None,
    *,
    planes: int = 1,
    group: int = 128,
    gpu_experts: int | None = None,
    host_kernel: str = "xla",
    host_workers: int | None = None,
    mesh: Mesh | None = None,
    expert_exchange: str = "gather",
    host_path: str = "compute",
    copy_slots: int | None = None,
    prefill_copy_slots: int | None = None,
    stream_copy: str = "auto",
    host_memory: str = "auto",
    prefill_attention: str = "auto",
    fused_decode: bool = False,
) -> LoadedModel:
    """Loads a Hugging Face checkpoint directory (config.json + safetensors [+ index] + tokenizer files), or a
    directory written by `python -m strata_jax quantize` (its experts stay packed as converted).

    dtype: "float32" or "bfloat16" (weights and activations; recurrent state is always float32).
    quantize: None (dense experts) or "1bit": routed experts become `planes` residual sign bit-planes with one
    bf16 scale per `group` inputs, converted while loading, and run through `pallas_kernels`.
    gpu_experts: packed experts only: experts per MoE layer kept in the device pool (e.g. the planner's
    `MemoryPlan.gpu_experts`); the others are computed on the host from the same packed bytes (strata_jax/host).
    None (or >= the number of experts): every expert on the device.
    host_kernel / host_workers: the host experts' implementation ("xla", compiled by XLA:CPU, or "numpy", the
    reference) and threads (None: from the CPU quota granted), for the model's `HostPool` (`LoadedModel.host_pool`).
    mesh: a `data` x `expert` jax Mesh (`strata_jax.engine.mesh.MeshConfig.make()`): routed experts (or the device
    pool of `gpu_experts`, which must then split evenly) divided over its `expert` axis, dense weights replicated;
    `expert_exchange` ("gather" or "all_to_all") is how the engine's decode and verify steps move tokens to them.
    The weights are loaded as without a mesh, then placed.
    host_path: how experts outside the pool are served: "compute" (on the host CPU, above) or "stream" (kept in
    pinned host memory and copied into the step; `copy_slots` / `prefill_copy_slots`: its staging rows, None: sized
    per call; `stream_copy`: how rows cross, "slices", "pallas" or "auto"; `host_memory`: where they live, "pinned",
    "mapped" or "auto"). See `ExpertQuantization` and
    `strata_jax.model.expert_stream`.
    prefill_attention: how prefill chunks attend (`ModelConfig.prefill_attention_impl`: "auto", "jnp", "pallas" the
    flash-style kernel, "cudnn", "selected" the kernel reading only each token's QSA-selected keys;
    pallas_kernels.flash_prefill.resolve_prefill_impl).
    fused_decode: decode and verify calls of <= 16 tokens run the fused Pallas kernels on a GPU
    (`strata_jax.model.decoder.enable_fused_decode`; off by default: slower in the step, docs/PERF.md).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if quantize not in (None, "1bit"):
        raise ValueError(f"quantize must be None or '1bit', got {quantize!r}")
    path = Path(path)
    if path.suffix == ".gguf":
        return _load_gguf(path, dtype, quantize, planes, group, gpu_experts, host_kernel, host_workers, mesh,
                          expert_exchange, dict(host_path=host_path, copy_slots=copy_slots,
                                                prefill_copy_slots=prefill_copy_slots, stream_copy=stream_copy,
                                                host_memory=host_memory),
                          prefill_attention,
                          fused_decode)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    started = time.monotonic()
    config = dataclasses.replace(load_config(path), prefill_attention_impl=prefill_attention)
    jdtype = _DTYPES[dtype]
    pool = HostPool(kernel=host_kernel_beside(mesh, host_kernel), workers=host_workers)
    host_experts = functools.partial(HostTier, pool=pool)
    paths = dict(host_path=host_path, copy_slots=copy_slots, prefill_copy_slots=prefill_copy_slots,
                 stream_copy=stream_copy, host_memory=host_memory)
    if is_converted(path):
        meta = read_marker(path)
        quant = ExpertQuantization(planes=meta["planes"], group=meta["group"], gpu_experts=gpu_experts, **paths)
        with_mtp = (path / "params" / "mtp").is_dir()
        model = nnx.eval_shape(lambda: CausalLM(config, jdtype, with_mtp=with_mtp, quant=quant,
                                                host_experts=host_experts))
        restore_params(model, path)
        reader = CheckpointReader(path) if config.ple_layers else None
    else:
        quant = (ExpertQuantization(planes=planes, group=group, gpu_experts=gpu_experts, **paths)
                 if quantize == "1bit" else None)
        if quant is None and gpu_experts is not None:
            raise ValueError("gpu_experts needs packed experts (quantize='1bit' or a converted checkpoint)")
        reader = CheckpointReader(path)
        with_mtp = has_mtp(reader)
        model = nnx.eval_shape(lambda: CausalLM(config, jdtype, with_mtp=with_mtp, quant=quant,
                                                host_experts=host_experts))
        fill_params(model, config, reader, jdtype)
    tables = load_ple_tables(config, reader) if reader is not None else []
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from strata_jax.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
    if fused_decode:
        enable_fused_decode(model)
    if sys.stderr.isatty():
        print(f"loaded {path} ({config.family}, {dtype}) in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return LoadedModel(path, config, model, jdtype, tables, tokenizer, host_pool=pool, mesh=mesh,
                       expert_exchange=expert_exchange)


def _load_gguf(path: Path, dtype: str, quantize: str | None, planes: int, group: int, gpu_experts: int | None,
               host_kernel: str, host_workers: int | None, mesh: Mesh | None, expert_exchange: str,
               paths: dict, prefill_attention: str = "auto", fused_decode: bool = False) -> LoadedModel:
    """`load_model` for a llama.cpp GGUF file (or split set): see `strata_jax.weights.gguf_loader`."""
    from strata_jax.weights.gguf_loader import build_from_gguf

    started = time.monotonic()
    pool = HostPool(kernel=host_kernel_beside(mesh, host_kernel), workers=host_workers)
    built = build_from_gguf(path, _DTYPES[dtype], quantize, planes=planes, group=group, gpu_experts=gpu_experts,
                            host_experts=functools.partial(HostTier, pool=pool), quant_options=paths,
                            prefill_attention=prefill_attention)
    if fused_decode:
        enable_fused_decode(built.model)
    loaded = LoadedModel(path, built.config, built.model, _DTYPES[dtype], built.ple_tables, built.tokenizer,
                         host_pool=pool, mesh=mesh, expert_exchange=expert_exchange, ple_hashers=built.ple_hashers)
    loaded.gguf_report = built.report
    if sys.stderr.isatty():
        print(f"loaded {path} (GGUF, {built.config.family}, {dtype}) in {time.monotonic() - started:.1f}s",
              file=sys.stderr)
    return loaded
