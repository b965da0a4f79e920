"""Synthetic models at real shapes, built directly on the device (no checkpoint), for benchmarks.

`PRESETS["flash-next-125b"]` is Qwen3.8-Flash-Next's text model as docs/ARCHITECTURE.md ("Background") gives it.
Weights are random (never zeros: routing, attention and kernels see realistic data), created parameter by parameter
on the device.
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


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig.from_hf_dict(PRESETS[name])


def synthetic_model(cfg: ModelConfig, dtype=jnp.bfloat16, quant: ExpertQuantization | None = None, seed: int = 0,
                    *, host_pool: HostPool | None = None):
    """A CausalLM with random weights, every parameter created directly on the default device.

    With a host expert tier (`quant.gpu_experts` < experts), each MoE layer's full expert stack is generated on the
    device one layer at a time and moved to host RAM, computed there on `host_pool` (default: a new one); its first
    `gpu_experts` experts fill the device pool."""
    host_experts = functools.partial(HostTier, pool=host_pool if host_pool is not None else HostPool())
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype, quant=quant, host_experts=host_experts))
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


def random_cache(cfg, slots, ctx, fill, dtype, kv_dtype=None):
    """A slot cache of `slots` x `ctx` positions with random contents (never time on zeros) and `fill` tokens in
    every slot. `kv_dtype`: K and V stored quantized (int8 / float8_e4m3fn, `init_cache`), random bytes too."""
    cache = init_cache(cfg, slots, ctx, dtype, kv_dtype=kv_dtype)
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
    return cache.replace(lengths=jnp.full((slots,), fill, jnp.int32))
