"""Synthetic models at real shapes, built directly on the device (no checkpoint), for benchmarks.

`PRESETS["flash-next-125b"]` is Qwen3.8-Flash-Next's text model as docs/ARCHITECTURE.md ("Background") gives it.
Weights are random (never zeros: routing, attention and kernels see realistic data), created parameter by parameter
on the device.

A real checkpoint also has an MTP head (`synthetic_model(..., with_mtp=True)`) and PLE (`preset_config(name,
ple=True)`: `PLE_PARTS`, one n-gram layer whose rows the host gathers before every step from a table in host
memory, `synthetic_ple_tables`). The real table has 20M rows per n-gram head (16 heads of 160 values: 51.2B values,
95 GiB in bf16); the synthetic one keeps the real row width and heads but `ple_rows_per_head` rows per head
(default `PLE_ROWS_PER_HEAD`: 262,144, a 1.3 GiB bf16 table). A token still gathers 16 rows of 160 values from a
table far larger than any cache, hashed exactly as the real one; only the page-table reach differs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.host.pool import HostPool
from strata_jax.host.tier import HostTier
from strata_jax.model.config import ExpertQuantization, ModelConfig
from strata_jax.model.cache import init_cache
from strata_jax.model.decoder import CausalLM
from strata_jax.model.moe import QuantizedExperts
from strata_jax.model.ple_hash import NgramHasher, PleTable

_FLASH_NEXT = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 48,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "hc_count": 4,
    "hc_lowrank": 320,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "output_gate_type": "sigmoid",
    "eos_token_id": 248044,
    "max_position_embeddings": 262144,
}

# A small model of the same architecture, for checking the benchmark code on a CPU.
_TINY = {
    **_FLASH_NEXT,
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "hc_lowrank": 32,
    "indexer_n_heads": 2,
    "indexer_head_dim": 32,
    "indexer_budget": 64,
    "eos_token_id": 1,
}

PRESETS = {"flash-next-125b": _FLASH_NEXT, "tiny": _TINY}

# Flash-Next's PLE (per-layer n-gram embedding): one PLE layer (one-indexed 2: model.layers.1, Gated DeltaNet),
# 2- and 3-grams with 8 hash heads each (16 rows per token), each row 160 values (ple_embed_dim 2560 = hidden / 16).
# ngram_vocab_size_base is the real rows per head (20M); preset_config scales it to `ple_rows_per_head`.
_FLASH_NEXT_PLE = {
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
}
PLE_PARTS = {"flash-next-125b": _FLASH_NEXT_PLE, "tiny": {**_FLASH_NEXT_PLE, "ple_embed_dim": 128}}
# Presets whose step and users benchmarks include the MTP head and PLE unless --no-mtp / --no-ple (tiny, the
# benchmark code's CPU check, takes them with --mtp / --ple).
REAL_PARTS_BY_DEFAULT = ("flash-next-125b",)
PLE_ROWS_PER_HEAD = 262_144  # the synthetic table's rows per head: 16 x 262,147 x 160 bf16 values = 1.3 GiB


def preset_config(name: str, ple: bool = False, ple_rows_per_head: int = PLE_ROWS_PER_HEAD) -> ModelConfig:
    """The preset's ModelConfig; with `ple`, plus its PLE layer, the table scaled to `ple_rows_per_head` rows per
    n-gram head (the hash then maps into that many; row width and heads stay the real ones)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    if not ple:
        return ModelConfig.from_hf_dict(PRESETS[name])
    if ple_rows_per_head < 2:
        raise ValueError(f"ple_rows_per_head must be >= 2, got {ple_rows_per_head}")
    return ModelConfig.from_hf_dict({**PRESETS[name], **PLE_PARTS[name], "ngram_vocab_size_base": ple_rows_per_head})


def synthetic_ple_tables(cfg: ModelConfig, seed: int = 0) -> list[PleTable]:
    """Host PLE tables (bf16, as a checkpoint stores them) for `cfg.ple_layers`, of the rows the hash addresses.
    Random values (never zeros); a block of 65,536 random rows is repeated down the table, which is written in
    seconds rather than drawn value by value (the gather's cost does not depend on the values)."""
    tables = []
    for i, _ in enumerate(cfg.ple_layers):
        rows = NgramHasher.for_layer(cfg, i).table_rows
        dim = cfg.ple_embed_dim // cfg.ple_ngram_heads
        block = np.random.default_rng([seed, i]).normal(0.0, 0.1, (min(rows, 65_536), dim))
        block = block.astype(jnp.bfloat16)
        table = np.empty((rows, dim), jnp.bfloat16)
        for start in range(0, rows, block.shape[0]):
            n = min(block.shape[0], rows - start)
            table[start : start + n] = block[:n]
        tables.append(PleTable([table]))
    return tables


class SyntheticPle:
    """The host half of PLE for benchmark steps: each slot's n-gram context, and the rows of a step's tokens
    gathered from the tables (the path `LoadedModel.ple_inputs` takes)."""

    def __init__(self, cfg: ModelConfig, tables: list[PleTable], slots: int):
        self.hashers = [NgramHasher.for_layer(cfg, i) for i in range(len(cfg.ple_layers))]
        self.tables = tables
        self.contexts = [h.initial_context(slots) for h in self.hashers]

    def rows(self, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
        """float32 rows [S, T, ple_embed_dim] per PLE layer for tokens [S, T]; every slot's context moves past them."""
        tokens = np.asarray(tokens, np.int64)
        out = []
        for j, (hasher, table) in enumerate(zip(self.hashers, self.tables)):
            out.append(table.gather(hasher.row_ids(self.contexts[j], tokens), np.float32))
            self.contexts[j] = hasher.next_context(self.contexts[j], tokens)
        return tuple(out)


def synthetic_model(cfg: ModelConfig, dtype=jnp.bfloat16, quant: ExpertQuantization | None = None, seed: int = 0,
                    *, host_pool: HostPool | None = None, with_mtp: bool = False):
    """A CausalLM with random weights, every parameter created directly on the default device; `with_mtp`: with
    the MTP head (one attention decoder layer with its own MoE) a real checkpoint carries.

    With a host expert tier (`quant.gpu_experts` < experts), each MoE layer's full expert stack is generated on the
    device one layer at a time and moved to host RAM, computed there on `host_pool` (default: a new one); its first
    `gpu_experts` experts fill the device pool."""
    host_experts = functools.partial(HostTier, pool=host_pool if host_pool is not None else HostPool())
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype, with_mtp=with_mtp, quant=quant, host_experts=host_experts))
    key = jax.random.key(seed)
    tiered = {p: n for p, n in nnx.iter_graph(model) if isinstance(n, QuantizedExperts) and n.host is not None}
    params = [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Param)]
    for i, (path, param) in enumerate(params):
        if path[:-1] in tiered:
            continue
        param.set_value(_random(jax.random.fold_in(key, i), tuple(param.shape), param.dtype, str(path[-1])))
    for j, module in enumerate(tiered.values()):
        k = jax.random.fold_in(key, len(params) + j)
        for n, kind in enumerate(("gate_up", "down")):
            bits, scales = getattr(module, f"{kind}_bits"), getattr(module, f"{kind}_scales")
            e = module.num_experts
            b = np.asarray(_random(jax.random.fold_in(k, 2 * n), (e, *bits.shape[1:]), bits.dtype, "bits"))
            sc = np.asarray(_random(jax.random.fold_in(k, 2 * n + 1), (e, *scales.shape[1:]), scales.dtype, "scales"))
            module.load(kind, b, sc)
    return model


def make_greedy_chain(model, cfg: ModelConfig, seed: int = 0, scale: float = 64.0) -> np.ndarray:
    """Benchmark-only: rewrites a synthetic model's embedding and LM head so that its greedy next token is a fixed
    permutation of the current one, by a wide margin; returns the permutation (next = perm[current]).

    A random model's logits are nearly tied, so a verify window (other kernels, other sums) and a decode step pick
    different greedy tokens within a few tokens in bfloat16 (H200, 2026-12-03: the oracle's replay left its record
    at the 4th token). Here the residual stream is dominated by the token's embedding (scaled by `scale`: the layers
    add O(1) each) and LM head row perm[t] is embedding row t, so every path agrees on the argmax: the oracle
    drafter's replay then follows its record, and speculation is timed at the acceptance asked for. Shapes, kernels
    and bytes are those of the plain synthetic model; only these two tables change."""
    if cfg.tie_word_embeddings:
        raise ValueError("a greedy chain needs an LM head of its own (tie_word_embeddings is set)")
    embed = model.model.embed_tokens.weight
    table = embed[...]
    perm = np.random.default_rng(seed).permutation(cfg.vocab_size)
    inverse = jnp.asarray(np.argsort(perm))
    model.lm_head.weight.set_value(jnp.take(table, inverse, axis=0))
    embed.set_value((table.astype(jnp.float32) * scale).astype(table.dtype))
    return perm


def _random(key, shape, dtype, name):
    kind = "bits" if dtype == jnp.uint32 else "scales" if name.endswith("scales") else "normal"
    return _generator(shape, jnp.dtype(dtype).name, kind)(key)


@functools.lru_cache(maxsize=None)
def _generator(shape: tuple[int, ...], dtype_name: str, kind: str):
    """One compiled generator per distinct (shape, dtype, kind): a 48-layer model has a few dozen, not thousands."""
    dtype = jnp.dtype(dtype_name)
    if kind == "bits":
        return jax.jit(lambda k: jax.random.bits(k, shape, jnp.uint32))
    if kind == "scales":
        return jax.jit(lambda k: jax.random.uniform(k, shape, jnp.float32, 0.01, 0.03).astype(dtype))
    std = 0.1 if len(shape) == 1 else shape[-1] ** -0.5
    return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))


def random_cache(cfg, slots, ctx, fill, dtype, kv_dtype=None, with_mtp=False):
    """A slot cache of `slots` x `ctx` positions with random contents (never time on zeros) and `fill` tokens in
    every slot. `kv_dtype`: K and V stored quantized (int8 / float8_e4m3fn, `init_cache`), random bytes too.
    `with_mtp`: with the MTP head's cache, `fill` pairs in it too."""
    cache = init_cache(cfg, slots, ctx, dtype, kv_dtype=kv_dtype, with_mtp=with_mtp)
    key = jax.random.key(7)
    leaves, tree = jax.tree_util.tree_flatten(cache)

    def fill_random(i, x):
        k = jax.random.fold_in(key, i)
        if x.dtype == jnp.int8:  # quantized K / V
            return jax.random.randint(k, x.shape, -127, 128, jnp.int32).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return (jax.random.normal(k, x.shape, jnp.float32) * 0.1).astype(x.dtype)
        return x

    leaves = [fill_random(i, x) for i, x in enumerate(leaves)]
    cache = jax.tree_util.tree_unflatten(tree, leaves)
    if with_mtp:
        cache = cache.replace(mtp_lengths=jnp.full((slots,), fill, jnp.int32))
    return cache.replace(lengths=jnp.full((slots,), fill, jnp.int32))
