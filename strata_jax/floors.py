"""Floors of a decode step: the bytes it must move (over the copy bandwidth measured on the device) and the kernels
it launches (x the ~5 us each measured on the H200)."""

from __future__ import annotations

import re
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.config import ModelConfig
from strata_jax.model.moe import PackedExperts

LAUNCH_US = 5.0  # measured per-kernel cost of a small step on the H200 (DESIGN.md)
_KERNEL_OPS = re.compile(r"=\s*\S+\s+(fusion|custom-call|dot|convolution|scatter|gather|sort|reduce|copy|while)\(")


def copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Bytes/s of one fused elementwise pass (read + write) over a large random bf16 array."""
    n = int(gib * 2**30 / 2)
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.0001 + 0.5)
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n * 2 / statistics.median(times)


def count_kernels(hlo_text: str) -> int:
    """Kernel-launching instructions in a compiled module (fusions, custom calls, library calls, loops)."""
    return sum(1 for line in hlo_text.splitlines() if _KERNEL_OPS.search(line))


def step_bytes(cfg: ModelConfig, model, slots: int, fill: int) -> dict[str, float]:
    """The fewest bytes one decode step must read (and write, for recurrent state)."""
    dense = experts_per_layer = expert_layers = 0
    for path, node in nnx.iter_graph(model):
        if isinstance(node, PackedExperts):
            expert_layers += 1
            experts_per_layer = sum(
                getattr(node, n)[...].nbytes for n in ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")
            )
        elif isinstance(node, nnx.Param) and "experts" not in str(path) and "embed_tokens" not in str(path):
            dense += node[...].nbytes
    per_expert = experts_per_layer / cfg.num_experts
    distinct = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** slots)
    n_attn = cfg.layer_types.count("full_attention")
    n_lin = cfg.num_layers - n_attn
    kv_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 2 + (cfg.indexer_head_dim * 2 if cfg.qsa else 0)
    state = cfg.linear_num_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4
    return {
        "dense": dense,
        "experts": expert_layers * distinct * per_expert,
        "kv": n_attn * slots * fill * kv_tok,
        "recurrent": 2 * n_lin * slots * state,
        "embed": slots * cfg.hidden_size * 2,
    }
