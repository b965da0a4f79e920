"""Benchmark of the 1-bit MoE expert kernels at Flash-Next shapes.

    python -m strata_jax.bench.kernels [--json FILE] [--tokens 1,2,4,8,16,32,64] [--planes 1,2]
                                       [--variants NAME,...] [--reps 7] [--iters 40] [--unroll 4]
                                       [--parts prep,VARIANT] [--quick]

Times one MoE layer's routed experts (gate_up + SiLU*up + down + weighted sum over top-k) per
implementation against (a) the memory floor = bytes of the distinct experts touched (packed bits +
scales) / device copy bandwidth measured in the same run, (b) the compute floor = the routed experts'
matmul FLOPs, T*k*(2*H*2I + 2*I*H), / the bf16 matmul rate measured in the same run, (c) bf16 baselines
on the same experts dequantized once outside the timed loop: the XLA gather-einsum (`bf16`, decode sizes),
the grouped GEMM of the model's dense path (`ragged_bf16`: pairs sorted by expert, `lax.ragged_dot`) and a
capacity-padded batched GEMM (`padded_bf16`), and (d) the plain-XLA unpack path. Checks every Pallas
variant and bf16 baseline against the float32 XLA path first.

Method: each timed function is a jitted ``lax.scan`` over ``--iters`` layers; every iteration gets its
own routing, its own x and its own copy of the experts (``--layers`` copies stacked along the expert
axis, offset per iteration) so no layer finds the previous one's weights in L2; the time per layer
is the scan's time / iters, the median of ``--reps`` runs after a warm-up. An empty scan (same
inputs, trivial body) is timed too: its per-iteration cost is the loop overhead included above
(~20 us per iteration on an H200 with --unroll 1, ~5 us with --unroll 4).
Random data throughout (never zeros). Imports only strata_jax.bench.common from strata_jax.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import KernelConfig, PackedExperts, default_config, dequantize, moe_experts_1bit
from pallas_kernels.onebit_format import dequantize_planes
from strata_jax.bench.common import matmul_rate

HIDDEN, INTER, EXPERTS, TOPK, GROUP = 2560, 640, 512, 10, 128


def _grouped(bm: int, bn: int, warps: int, bkw: int = 4, **kw) -> tuple[str, KernelConfig]:
    """A grouped MMA variant with ``bm`` rows per expert block and the same tiles in gate_up and down."""
    return "pallas", KernelConfig(schedule="grouped", bm=bm, bn1=bn, bkw1=bkw, bn2=bn, bkw2=bkw, num_warps=warps, **kw)


def _lut(schedule: str = "pairs", **tiles) -> tuple[str, KernelConfig]:
    """A lookup-table variant (compute="lut") of the Pallas kernels."""
    return "pallas", KernelConfig(schedule=schedule, compute="lut", **tiles)


# name -> (impl, KernelConfig or None)
VARIANTS = {
    "xla": ("xla", None),
    "auto": ("pallas", None),  # the default per-T choice of pallas_kernels.default_config
    "pairs": ("pallas", KernelConfig(schedule="pairs")),
    "pairs_k8": ("pallas", KernelConfig(schedule="pairs", bkw1=8, bkw2=4)),
    "pairs_k8_split": ("pallas", KernelConfig(schedule="pairs", bkw1=8, bkw2=4, split_pairs=True)),
    "pairs_k8_split_tf32": ("pallas", KernelConfig(schedule="pairs", bkw1=8, bkw2=4, split_pairs=True,
                                                   compute="mma_tf32")),
    "pairs_k8_split_x16": ("pallas", KernelConfig(schedule="pairs", bkw1=8, bkw2=4, split_pairs=True, unpack="xor16")),
    "pairs_n16_k8_split": ("pallas", KernelConfig(schedule="pairs", bn1=16, bkw1=8, bn2=16, bkw2=4, split_pairs=True)),
    "pairs_k4_split_w2": ("pallas", KernelConfig(schedule="pairs", bkw1=4, bkw2=4, split_pairs=True, num_warps=2)),
    "pairs_k4_split_w2_x16": ("pallas", KernelConfig(schedule="pairs", bkw1=4, bkw2=4, split_pairs=True, num_warps=2,
                                                     unpack="xor16")),
    "pairs_n64_k2": ("pallas", KernelConfig(schedule="pairs", bn1=64, bkw1=2, bn2=64, bkw2=2)),
    "pairs_sel": ("pallas", KernelConfig(schedule="pairs", unpack="select")),
    "pairs_vpu": ("pallas", KernelConfig(schedule="pairs", compute="vpu", bn1=32, bkw1=1, bn2=32, bkw2=1)),
    "pairs_2d": ("pallas", KernelConfig(schedule="pairs", compute="mma2d", bn1=32, bkw1=4, bn2=32, bkw2=4)),
    "pairs_2d_n64": ("pallas", KernelConfig(schedule="pairs", compute="mma2d", bn1=64, bkw1=4, bn2=64, bkw2=4)),
    "pairs_2d_n16": ("pallas", KernelConfig(schedule="pairs", compute="mma2d", bn1=16, bkw1=4, bn2=16, bkw2=4)),
    "pairs_v2d": ("pallas", KernelConfig(schedule="pairs", compute="vpu2d", bn1=32, bkw1=4, bn2=32, bkw2=4)),
    "pairs_v2d_n64": ("pallas", KernelConfig(schedule="pairs", compute="vpu2d", bn1=64, bkw1=4, bn2=64, bkw2=4)),
    "pairs_v2d_n128": ("pallas", KernelConfig(schedule="pairs", compute="vpu2d", bn1=128, bkw1=2, bn2=128, bkw2=2)),
    "pairs_v2d_w8": ("pallas", KernelConfig(schedule="pairs", compute="vpu2d", bn1=128, bkw1=2, bn2=128, bkw2=2,
                                            num_warps=8)),
    "grouped": ("pallas", KernelConfig(schedule="grouped")),
    "grouped_n64": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64)),
    "grouped_k8": ("pallas", KernelConfig(schedule="grouped", bkw1=8, bkw2=4)),
    "grouped_n64_k8": ("pallas", KernelConfig(schedule="grouped", bn1=64, bkw1=8, bn2=64, bkw2=4)),
    "grouped_n128_w8": ("pallas", KernelConfig(schedule="grouped", bn1=128, bn2=128, num_warps=8)),
    "grouped_n64_s4": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64, num_stages=4)),
    "grouped_n64_w8": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64, num_warps=8)),
    "grouped_n64_w2": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64, num_warps=2)),
    "grouped_n64_w2_tf32": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64, num_warps=2,
                                                   compute="mma_tf32")),
    "grouped_n64_w2_x16": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64, num_warps=2, unpack="xor16")),
    "grouped_n64_w4_tf32": ("pallas", KernelConfig(schedule="grouped", bn1=64, bn2=64, num_warps=4,
                                                   compute="mma_tf32")),
    "grouped_n32_w2": ("pallas", KernelConfig(schedule="grouped", bn1=32, bn2=32, num_warps=2)),
    "grouped_n128_w4": ("pallas", KernelConfig(schedule="grouped", bn1=128, bn2=128, num_warps=4)),
    "pairs_k4_split_w2_i8": ("pallas", KernelConfig(schedule="pairs", bkw1=4, bkw2=4, split_pairs=True, num_warps=2,
                                                    compute="mma_i8")),
    "grouped_n128_w4_i8": ("pallas", KernelConfig(schedule="grouped", bn1=128, bn2=128, num_warps=4, compute="mma_i8")),
    "grouped_n128_w4_x16": ("pallas", KernelConfig(schedule="grouped", bn1=128, bn2=128, num_warps=4, unpack="xor16")),
    "grouped_n64_k2_w2": ("pallas", KernelConfig(schedule="grouped", bn1=64, bkw1=2, bn2=64, bkw2=2, num_warps=2)),
    # compute="lut" (pallas_kernels/onebit_lut.py): nibble lookup tables of the activations, no dot. Names: k = words
    # per K step (bkw1 = bkw2), w = warps, s = gate_up's K split, n / g / d = column tiles (both / gate_up / down).
    "lut_pairs_w2": _lut(num_warps=2),
    "lut_pairs_w1": _lut(num_warps=1),
    "lut_pairs_k8_w2": _lut(bkw1=8, bkw2=8, num_warps=2),
    "lut_pairs_n64_w2": _lut(bn1=64, bn2=64, num_warps=2),
    "lut_pairs_n16_w1": _lut(bn1=16, bn2=16, num_warps=1),
    "lut_grouped_n64_w2": _lut("grouped", bn1=64, bn2=64, num_warps=2),
    "lut_grouped_n128_w4": _lut("grouped", bn1=128, bn2=128, num_warps=4),
    "lut_grouped_n128_w4_bf16": _lut("grouped", bn1=128, bn2=128, num_warps=4, lut_table="bfloat16"),
    "lut_grouped_n32_w1": _lut("grouped", bn1=32, bn2=32, num_warps=1),
    "lut_pairs_k8_w2_s2": _lut(bkw1=8, bkw2=8, num_warps=2, lut_ksplit=2),
    "lut_pairs_k8_w2_s5": _lut(bkw1=8, bkw2=8, num_warps=2, lut_ksplit=5),
    "lut_pairs_k4_w2_s4": _lut(num_warps=2, lut_ksplit=4),
    "lut_pairs_k8_w2_bf16": _lut(bkw1=8, bkw2=8, num_warps=2, lut_table="bfloat16"),
    "lut_pairs_n64_k8_w4": _lut(bn1=64, bkw1=8, bn2=64, bkw2=8, num_warps=4),
    "lut_pairs_k8_w4": _lut(bkw1=8, bkw2=8, num_warps=4),
    "lut_pairs_k8_w4_s5": _lut(bkw1=8, bkw2=8, num_warps=4, lut_ksplit=5),
    "lut_pairs_k8_w4_s10": _lut(bkw1=8, bkw2=8, num_warps=4, lut_ksplit=10),
    "lut_pairs_k8_w2_s10": _lut(bkw1=8, bkw2=8, num_warps=2, lut_ksplit=10),
    "lut_pairs_k4_w4_s10": _lut(num_warps=4, lut_ksplit=10),
    "lut_pairs_n64_k8_w4_s5": _lut(bn1=64, bkw1=8, bn2=64, bkw2=8, num_warps=4, lut_ksplit=5),
    **{f"lut_g{g}_k{kw}_w{w}_s{sp}": _lut(bn1=g, bkw1=kw, bn2=32, bkw2=8, num_warps=w, lut_ksplit=sp)
       for g, kw, w, sp in ((64, 8, 4, 5), (128, 8, 4, 5), (128, 8, 4, 10), (64, 16, 4, 5), (64, 8, 8, 5),
                            (256, 8, 8, 5))},
    **{f"lut_g{g}_d{d}{'_bf16' if bf else ''}": _lut(bn1=g, bkw1=8, bn2=d, bkw2=8, num_warps=4, lut_ksplit=5,
                                                     lut_table="bfloat16" if bf else "float32")
       for g, d, bf in ((32, 32, True), (64, 64, True), (64, 128, True), (128, 128, True), (64, 128, False),
                        (32, 64, True))},
    # the same tiles with byte tables (_b8: 256 entries per 8 inputs) and/or the K steps unrolled (_u)
    **{f"lut_g{g}_d{d}{'_bf16' if bf else ''}{'_b8' if b8 else ''}{'_u' if u else ''}":
       _lut(bn1=g, bkw1=8, bn2=d, bkw2=8, num_warps=4, lut_ksplit=5, lut_table="bfloat16" if bf else "float32",
            lut_bits=8 if b8 else 4, lut_unroll=u)
       for g, d in ((32, 32), (64, 128)) for bf in (False, True) for b8 in (False, True) for u in (False, True)
       if b8 or u},
    # words loaded with the evict-first cache hint (_ef), leaving L1 to the tables
    **{f"lut_g{g}_d{d}{'_bf16' if bf else ''}_ef": _lut(bn1=g, bkw1=8, bn2=d, bkw2=8, num_warps=4, lut_ksplit=5,
                                                          lut_table="bfloat16" if bf else "float32", lut_stream=True)
       for g, d, bf in ((32, 32, False), (64, 128, True), (64, 128, False), (64, 64, True))},
    # pairs sorted by expert (blocks of one row, group_pairs' order): a shared expert's second read hits L2
    "lut_sorted_k8_w2": _lut("grouped", bm=1, bkw1=8, bkw2=8, num_warps=2),
    "lut_sorted_k8_w2_bf16": _lut("grouped", bm=1, bkw1=8, bkw2=8, num_warps=2, lut_table="bfloat16"),
    "grouped_2d": ("pallas", KernelConfig(schedule="grouped", compute="mma2d")),
    "grouped_2d_n64": ("pallas", KernelConfig(schedule="grouped", compute="mma2d", bn1=64, bn2=64)),
    "grouped_2d_n128": ("pallas", KernelConfig(schedule="grouped", compute="mma2d", bn1=128, bn2=128, num_warps=8)),
    # prefill chunks (T = 512-4096: ~10-80 rows per expert): blocks of bm = 32-128 rows, so an expert's bits are
    # unpacked about once per chunk rather than once per 16 rows. Names: m = rows per block, n = column tiles (gate_up
    # resolves to at most 128 of its 640), k = words per K step if not 4, w = warps, s = pipeline stages if not 3.
    "grouped_m32_n64_w4": _grouped(32, 64, 4),
    "grouped_m32_n128_w4": _grouped(32, 128, 4),
    "grouped_m64_n64_w4": _grouped(64, 64, 4),
    "grouped_m64_n128_w4": _grouped(64, 128, 4),
    "grouped_m64_n128_w8": _grouped(64, 128, 8),
    "grouped_m64_n128_k8_w4": _grouped(64, 128, 4, bkw=8),
    "grouped_m64_n128_w4_s4": _grouped(64, 128, 4, num_stages=4),
    "grouped_m64_n128_w4_x16": _grouped(64, 128, 4, unpack="xor16"),
    "grouped_m128_n64_w8": _grouped(128, 64, 8),
    "grouped_m128_n128_w8": _grouped(128, 128, 8),
    # the prefill kernel's (m64_n128_w4_x16) unpack amortised over more rows per block, with narrower column tiles so
    # that gate_up's two accumulators stay at 64 registers per thread (4 warps) or fewer
    "grouped_m64_n64_w4_x16": _grouped(64, 64, 4, unpack="xor16"),
    "grouped_m128_n64_w4_x16": _grouped(128, 64, 4, unpack="xor16"),
    "grouped_m128_n64_w8_x16": _grouped(128, 64, 8, unpack="xor16"),
    "grouped_m128_n32_w4_x16": _grouped(128, 32, 4, unpack="xor16"),
    "grouped_m256_n32_w8_x16": _grouped(256, 32, 8, unpack="xor16", num_stages=2),
    "grouped_m256_n64_w8_x16": _grouped(256, 64, 8, unpack="xor16", num_stages=2),
    # the prefill kernel's tile with fewer registers per thread (8 warps share the accumulators) or less shared memory
    # per program (two pipeline stages): ncu found it latency-bound at 12.5% occupancy (168 registers, 94 KB)
    "grouped_m64_n128_w8_x16": _grouped(64, 128, 8, unpack="xor16"),
    "grouped_m64_n128_w4_x16_s2": _grouped(64, 128, 4, unpack="xor16", num_stages=2),
    "grouped_m64_n128_w8_x16_s2": _grouped(64, 128, 8, unpack="xor16", num_stages=2),
    "grouped_m64_n64_w4_x16_s2": _grouped(64, 64, 4, unpack="xor16", num_stages=2),
    # half the K step (2 words, 64 inputs): the two unpacked weight tiles held per step halve ([64, 128] each), the
    # same tile and rows per program; with room for a fourth pipeline stage
    "grouped_m64_n128_k2_w4_x16": _grouped(64, 128, 4, bkw=2, unpack="xor16"),
    "grouped_m64_n128_k2_w4_x16_s4": _grouped(64, 128, 4, bkw=2, unpack="xor16", num_stages=4),
    "grouped_m64_n128_k2_w8_x16": _grouped(64, 128, 8, bkw=2, unpack="xor16"),
    # the unpacked weights as the dot's left operand (compute="mma_t"): Hopper's wgmma may take it from registers
    "grouped_m64_n128_w4_x16_t": _grouped(64, 128, 4, unpack="xor16", compute="mma_t"),
    "grouped_m128_n64_w4_x16_t": _grouped(128, 64, 4, unpack="xor16", compute="mma_t"),
    "grouped_m128_n64_w8_x16_t": _grouped(128, 64, 8, unpack="xor16", compute="mma_t"),
}


def log(*a):
    print(*a, flush=True)


def random_packed(key, n_experts, out_f, in_f, planes, group, std=0.02) -> PackedExperts:
    """Random packed planes (uniform bits, scales ~ the magnitude a real quantized matrix gets)."""
    kb, ks = jax.random.split(key)
    bits = jax.random.bits(kb, (n_experts, planes, in_f // 32, out_f), jnp.uint32)
    ng = -(-in_f // group)
    base = std * 0.8 * 0.6 ** jnp.arange(planes, dtype=jnp.float32)[None, :, None, None]
    sc = base * (1 + 0.2 * jax.random.uniform(ks, (n_experts, planes, ng, out_f)))
    return PackedExperts(bits, sc.astype(jnp.bfloat16), group)


def routings(rng, n, t, k=None, e=None):
    k = TOPK if k is None else k
    e = EXPERTS if e is None else e
    ids = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(t)]) for _ in range(n)])
    logits = rng.standard_normal((n, t, k)).astype(np.float32)
    w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


def time_fn(fn, args, reps):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def copy_bandwidth(reps):
    n = 1 << 28  # 1 GiB of uint32
    a = jax.random.bits(jax.random.PRNGKey(1), (n,), jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    t, _ = time_fn(f, (a,), reps)
    g = jax.jit(lambda a: jnp.bitwise_xor.reduce(a.reshape(-1, 1024), axis=1))
    tr, _ = time_fn(g, (a,), reps)
    del a
    return 2 * n * 4 / t, n * 4 / tr


def bf16_layer(x, ids, w, gu, dn):
    """bf16 XLA gather-einsum baseline (dense bf16 experts gathered per pair)."""
    inter = dn.shape[-1]
    g = jnp.einsum("th,tkoh->tko", x, gu[ids], preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g[..., :inter]) * g[..., inter:]).astype(jnp.bfloat16)
    y = jnp.einsum("tki,tkhi->tkh", a, dn[ids], preferred_element_type=jnp.float32)
    return jnp.einsum("tkh,tk->th", y, w).astype(x.dtype)


def ragged_layer(x, ids, w, gu, dn):
    """bf16 grouped-GEMM baseline, the model's dense path at prefill sizes (strata_jax.model.moe): pairs sorted by
    expert, ``lax.ragged_dot`` for gate_up and for down over one layer's experts, stored [E, K, N] (ragged_dot's
    [group, contracting, output], so no transpose is timed); the outputs gathered back per pair and weighted."""
    t, k = ids.shape
    n_exp, _, two_i = gu.shape
    inter = two_i // 2
    flat = ids.reshape(-1) % n_exp  # the scan offsets ids per layer copy; one bf16 copy is 5 GB, never in L2
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    g = jax.lax.ragged_dot(x[order // k], gu, sizes).astype(jnp.float32)
    a = (jax.nn.silu(g[:, :inter]) * g[:, inter:]).astype(jnp.bfloat16)
    y = jax.lax.ragged_dot(a, dn, sizes).astype(jnp.float32)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.einsum("tkh,tk->th", y[inv].reshape(t, k, -1), w).astype(x.dtype)


def padded_layer(x, ids, w, gu, dn, *, capacity):
    """bf16 batched-GEMM baseline: each expert's pairs in a [capacity, H] slab (capacity >= its most rows, padding
    zero), one batched matmul per projection over the layer's experts ([E, K, N] as in ``ragged_layer``). Pads the
    work by capacity * E / (T * k), but runs on the library GEMM whatever XLA does with ragged_dot."""
    t, k = ids.shape
    n_exp, hidden, two_i = gu.shape
    inter = two_i // 2
    flat = ids.reshape(-1) % n_exp
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    slot = flat * capacity + inv - (jnp.cumsum(sizes) - sizes)[flat]  # pair -> row of its expert's slab
    xe = jnp.zeros((n_exp * capacity, hidden), x.dtype).at[slot].set(jnp.repeat(x, k, axis=0))
    g = jnp.einsum("ech,eho->eco", xe.reshape(n_exp, capacity, hidden), gu, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g[..., :inter]) * g[..., inter:]).astype(jnp.bfloat16)
    y = jnp.einsum("eci,eih->ech", a, dn, preferred_element_type=jnp.float32).reshape(n_exp * capacity, hidden)
    return jnp.einsum("tkh,tk->th", y[slot].reshape(t, k, hidden), w).astype(x.dtype)


# XLA's default for ragged_dot on CUDA is a masked dense dot over every group (E x the work); this option lowers it to
# cuDNN's grouped GEMM instead where the cuDNN version supports it.
CUDNN_RAGGED = {"xla_gpu_experimental_use_ragged_dot_fusion": True}
# bf16 baselines: name -> (layer function, XLA compiler options). "bf16" reads the [E, 2I, H] copies of every layer
# copy; the others one layer's experts in the [E, K, N] layout; "ragged_bf16_xla" is ragged_dot at XLA's defaults.
DENSE_BASELINES = {
    "bf16": (bf16_layer, None),
    "ragged_bf16": (ragged_layer, CUDNN_RAGGED),
    "ragged_bf16_xla": (ragged_layer, None),
    "padded_bf16": (padded_layer, None),
}
RAGGED_MAX_EXPANSION = 4.0  # compiled FLOPs / routed FLOPs above which ragged_dot was expanded densely
BF16_GATHER_MAX_BYTES = 16 << 30  # the gather baseline copies each pair's bf16 expert: 13 GB at T = 128


def routed_flops(tokens: int) -> float:
    """Matmul FLOPs of one layer's routed experts: T*k*(2*H*2I + 2*I*H) (gate_up 2/3 of it, down 1/3)."""
    return tokens * TOPK * (2 * HIDDEN * 2 * INTER + 2 * INTER * HIDDEN)


def compiled_flops(fn, args, compiler_options=None) -> float:
    """FLOPs of fn(*args) by XLA's cost analysis of the compiled module (ragged_dot counted as its dense M*K*N)."""
    cost = jax.jit(fn, compiler_options=compiler_options).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def capacity_for(ids, n_exp: int) -> int:
    """The padded baseline's slab rows: the most pairs any expert gets in these routings, rounded up to 16."""
    most = max(int(np.bincount(np.asarray(r).reshape(-1) % n_exp, minlength=n_exp).max()) for r in ids)
    return -(-most // 16) * 16


def fits(name: str, tokens: int) -> bool:
    """Whether a bf16 baseline's working set fits at T = tokens (the gather baseline's grows with T * k)."""
    return name != "bf16" or tokens * TOPK * 6 * HIDDEN * INTER <= BF16_GATHER_MAX_BYTES


def dense_layer(name: str, ids):
    """A bf16 baseline's layer function for routings ``ids`` [n, T, k] (the padded one sized for them) and its XLA
    compiler options."""
    fn, options = DENSE_BASELINES[name]
    if fn is padded_layer:
        fn = functools.partial(padded_layer, capacity=capacity_for(ids, EXPERTS))
    return fn, options


def dense_experts(w: PackedExperts, n: int, transpose: bool):
    """bf16 copies of the first ``n`` experts: [n, N, K] (HF orientation), or [n, K, N] with ``transpose``."""
    deq = (lambda i: dequantize_planes(w.bits[i], w.scales[i], w.group)) if transpose else (lambda i: dequantize(w, i))
    return jnp.concatenate([deq(jnp.arange(i, min(i + 64, n))).astype(jnp.bfloat16) for i in range(0, n, 64)])


def make_scan(layer_fn, iters, layers, unroll=1, compiler_options=None):
    """`iters` layers in a jitted scan, layer i using expert copy i % layers; layer i+1's input depends on layer
    i's output (all of it when the shapes match, as in the model; else one element of it).

    The dependence is what makes every layer count: without it, the outputs of all but the last layer of each
    unrolled scan iteration are dead and XLA deletes their kernels, which made the first kernel tables ~3-4x too
    fast (docs/PERF.md, 1-bit MoE kernel)."""
    @functools.partial(jax.jit, compiler_options=compiler_options)
    def run(xs, ids, ws, *weights):
        def body(carry, inp):
            i, x, idx, wt = inp
            dep = carry if carry.shape == x.shape else jnp.ravel(carry)[0]
            x = x + (dep * 1e-3).astype(x.dtype)
            idx = idx + (i % layers) * EXPERTS
            return layer_fn(x, idx, wt, *weights), None

        n = xs.shape[0]
        its = jnp.arange(iters, dtype=jnp.int32)
        sel = its % n
        out = jax.eval_shape(layer_fn, xs[0], ids[0], ws[0], *weights)
        y, _ = jax.lax.scan(body, jnp.zeros(out.shape, out.dtype), (its, xs[sel], ids[sel], ws[sel]),
                            unroll=unroll)
        return y

    return run


def part_fn(name, interpret):
    """'VARIANT@gu' / 'VARIANT@dn': only the gate_up / only the down kernel of a pairs or grouped MMA variant
    ('auto': default_config(T)); the grouped ones include their routing prep (group_pairs, timed alone as 'prep')."""
    from pallas_kernels import onebit_pallas as op

    base, part = name.split("@")
    if part == "prep":
        def prep(x, i, w, g, d, h):
            blk_e, blk_pos, blk_n, tok, inv = op.group_pairs(i, g.num_experts, 16)
            return jnp.concatenate([blk_e, blk_pos, blk_n, tok, inv])

        return prep
    _, cfg = VARIANTS[base]
    if cfg is not None and cfg.compute == "lut":
        return _lut_part_fn(cfg, part, interpret)

    def fn(x, i, w, g, d, h):
        c = op._resolve(cfg or default_config(x.shape[0]), g, d)
        if c.compute == "lut":  # auto at T <= 128
            return _lut_part_fn(c, part, interpret)(x, i, w, g, d, h)
        grouped = c.schedule == "grouped" or (c.schedule == "auto" and x.shape[0] > c.pairs_max_tokens)
        if grouped:
            blocks = op.group_pairs(i, g.num_experts, c.bm)
            if part == "gu":
                return op.gate_up_grouped(x, blocks, g, c, interpret=interpret)
            return op.down_grouped(jnp.pad(h, ((0, c.bm), (0, 0))), blocks, d, c, interpret=interpret)
        if part == "gu":
            return op.gate_up_pairs(x, i, g, c, interpret=interpret)
        return op.down_pairs(h, i, w, d, x.dtype, c, interpret=interpret)

    return fn


def _lut_part_fn(cfg, part, interpret):
    """'@tab': both nibble tables; '@gu' / '@dn': the gate_up / down kernel alone (pairs blocks)."""
    from pallas_kernels import onebit_lut as ol
    from pallas_kernels import onebit_pallas as op

    dt = jnp.dtype(cfg.lut_table)
    tables = functools.partial(ol.nibble_tables, dtype=dt, bits=cfg.lut_bits)

    def fn(x, i, w, g, d, h):
        c = op._resolve(cfg, g, d)
        if part == "tab":
            return jnp.concatenate([tables(x), tables(h)])
        blocks = ol.pair_blocks(i)
        if part == "gu":
            return ol.gate_up_lut(tables(x), blocks, g, c, interpret=interpret)
        return ol.down_lut(tables(h), blocks, d, c, interpret=interpret)

    return fn


def run_once(tokens: list[int], names: list[str]) -> int:
    """Each variant's MoE layer at Flash-Next shapes (1 plane, random routing), 3 calls per T: a workload for a
    profiler such as Nsight Compute, which then sees 3 launches of every kernel per (variant, T)."""
    interpret = jax.default_backend() != "gpu"
    kg, kd, kx = jax.random.split(jax.random.PRNGKey(0), 3)
    gu = random_packed(kg, EXPERTS, 2 * INTER, HIDDEN, 1, GROUP)
    dn = random_packed(kd, EXPERTS, HIDDEN, INTER, 1, GROUP)
    rng = np.random.default_rng(0)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--once runs the kernel variants only; unknown: {', '.join(unknown)}")
    for name in names:
        impl, cfg = VARIANTS[name]
        fn = jax.jit(functools.partial(moe_experts_1bit, impl=impl, config=cfg, interpret=interpret))
        for t in tokens:
            ids, w = routings(rng, 1, t)
            x = jax.random.normal(jax.random.fold_in(kx, t), (t, HIDDEN), jnp.bfloat16)
            for _ in range(3):
                y = jax.block_until_ready(fn(x, ids[0], w[0], gu, dn))
            log(f"{name} T={t}: mean |y| {float(jnp.mean(jnp.abs(y.astype(jnp.float32)))):.4g}")
    return 0


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    global HIDDEN, INTER, EXPERTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1,2,4,8,16,32,64; --quick: 1,4)")
    ap.add_argument("--planes", default="1,2")
    ap.add_argument("--variants", default="xla,bf16,auto,pairs_k8,pairs_k8_split,grouped_n64_w2",
                    help="comma list of: " + ", ".join([*DENSE_BASELINES, *VARIANTS]))
    ap.add_argument("--planes2-variants", default="xla,auto",
                    help="variants timed for planes > 1")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--unroll", type=int, default=4, help="lax.scan unroll (amortizes XLA's per-iteration loop cost)")
    ap.add_argument("--parts", default="",
                    help="pairs, grouped or lut variants to also time per kernel (VARIANT@gu, VARIANT@dn; lut also "
                         "VARIANT@tab, its two nibble tables); 'prep': grouped routing prep")
    ap.add_argument("--experts", type=int, default=EXPERTS)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop timing new rows after this")
    ap.add_argument("--pairs-max-t", type=int, default=16, help="time pairs_* variants only up to this T")
    ap.add_argument("--grouped-min-t", type=int, default=4, help="time grouped_* variants only from this T")
    ap.add_argument("--check-tokens", default=None,
                    help="comma list of T for the correctness checks (default: the smallest, 8 and the largest of "
                         "--tokens); each check compiles every variant once more")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--once", action="store_true",
                    help="no timing: run each variant's MoE layer 3 times per --tokens (1 plane) and exit; for a "
                         "profiler, e.g. ncu -k regex:_gate_up_kernel --launch-skip 2 --launch-count 1 python -m ...")
    args = ap.parse_args(argv)
    if args.quick:
        HIDDEN, INTER, EXPERTS = 256, 64, 32
        args.tokens = args.tokens or "1,4"
        args.iters, args.reps, args.layers = 2, 1, 2
    else:
        EXPERTS = args.experts
    args.tokens = args.tokens or "1,2,4,8,16,32,64"
    if args.once:
        return run_once([int(s) for s in args.tokens.split(",")], [s for s in args.variants.split(",") if s])
    t_start = time.time()
    tokens = [int(s) for s in args.tokens.split(",")]
    planes_l = [int(s) for s in args.planes.split(",")]
    names = [s for s in args.variants.split(",") if s]
    unknown = [n for n in names if n not in VARIANTS and n not in DENSE_BASELINES]
    unknown += [n for n in args.parts.split(",") if n and n != "prep" and n not in VARIANTS]
    if unknown:  # before the device time goes into the checks
        raise SystemExit(f"unknown variants: {', '.join(unknown)}")
    if args.check_tokens:
        check_tokens = [int(s) for s in args.check_tokens.split(",")]
    else:
        check_tokens = sorted({min(tokens), 8, max(tokens)} & set(tokens) or {tokens[0]})
    dev = jax.devices()[0]
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{dev.platform} {getattr(dev, 'device_kind', '')}",
        "jax": jax.__version__,
        "command": "python -m strata_jax.bench.kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shapes": dict(hidden=HIDDEN, inter=INTER, experts=EXPERTS, topk=TOPK, group=GROUP),
        "iters": args.iters, "reps": args.reps, "layers": args.layers,
    }
    log("#", json.dumps(info))
    interpret = jax.default_backend() != "gpu"
    bw_copy, bw_read = copy_bandwidth(args.reps) if not args.quick else (1e11, 1e11)
    info["copy_bw_GBps"] = bw_copy / 1e9
    info["read_bw_GBps"] = bw_read / 1e9
    log(f"# copy bandwidth (read+write) {bw_copy / 1e9:.0f} GB/s, read-only reduce {bw_read / 1e9:.0f} GB/s")
    rate = matmul_rate(256, 3) if args.quick else matmul_rate()
    info["matmul_TFLOPs"] = rate / 1e12
    log(f"# bf16 matmul rate {rate / 1e12:.3g} TFLOP/s")
    results = []
    checks = []
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    n_rot = 8
    ne = EXPERTS * args.layers
    for planes in planes_l:
        kg, kd, key = jax.random.split(key, 3)
        gu = random_packed(kg, ne, 2 * INTER, HIDDEN, planes, GROUP)
        dn = random_packed(kd, ne, HIDDEN, INTER, planes, GROUP)
        bytes_per_expert = gu.bytes_per_expert + dn.bytes_per_expert
        want = names if planes == 1 else [n for n in names if n in args.planes2_variants.split(",")]
        # the bf16 baselines' own expert copies, built from the packed ones (float values): every layer copy for the
        # gather baseline, one layer's experts in the [E, K, N] layout for the grouped ones
        dense_wts = {}
        if planes == 1 and "bf16" in want:
            dense_wts["bf16"] = tuple(dense_experts(w, ne, transpose=False) for w in (gu, dn))
        if planes == 1 and any(n in DENSE_BASELINES and n != "bf16" for n in want):
            dense_wts["grouped"] = tuple(dense_experts(w, EXPERTS, transpose=True) for w in (gu, dn))
        baseline_wts = {n: dense_wts.get("bf16" if n == "bf16" else "grouped") for n in DENSE_BASELINES}
        for name in [n for n in want if DENSE_BASELINES.get(n, (None,))[0] is ragged_layer]:
            # On a GPU, never time (or check) a ragged_dot that XLA expanded into a dense dot over every expert: E x
            # the FLOPs, minutes per call at prefill sizes. Interpret runs (CPU) always expand it, at tiny shapes.
            if interpret or baseline_wts[name] is None:
                continue
            t0 = min(tokens)
            ids0, ws0 = routings(np.random.default_rng(1), 1, t0)
            x0 = jnp.zeros((t0, HIDDEN), jnp.bfloat16)
            fn, options = dense_layer(name, ids0)
            try:
                ratio = compiled_flops(fn, (x0, ids0[0], ws0[0], *baseline_wts[name]), options) / routed_flops(t0)
            except Exception as ex:  # e.g. a compiler option this jaxlib does not know
                ratio = float("inf")
                log(f"! {name}: {type(ex).__name__}: {str(ex)[:500]}")
            info.setdefault("ragged_flops_ratio", {})[name] = ratio
            if ratio > RAGGED_MAX_EXPANSION:
                log(f"# {name}: compiled FLOPs {ratio:.0f}x the routed FLOPs (ragged_dot expanded densely): not run")
                baseline_wts[name] = None
        # correctness at a few T against the float32 XLA path (itself checked against the numpy
        # float64 reference by the CPU tests)
        for t in check_tokens:
            ids, ws = routings(rng, 1, t)
            x = jax.random.normal(jax.random.PRNGKey(t), (t, HIDDEN), jnp.float32).astype(jnp.bfloat16)
            try:
                ref = jax.jit(lambda *a: moe_experts_1bit(*a, impl="xla"))(x.astype(jnp.float32), ids[0], ws[0], gu,
                                                                           dn)
            except Exception as ex:  # the XLA path unpacks per pair: at prefill sizes it may not fit
                log(f"! reference P{planes} T{t}: {type(ex).__name__}: {str(ex)[:500]}; no checks at this T")
                continue
            for name in want:
                if name == "xla" or (name in DENSE_BASELINES and (baseline_wts[name] is None or not fits(name, t))):
                    continue
                cfg = VARIANTS[name][1] if name in VARIANTS else None
                try:
                    if name in DENSE_BASELINES:
                        fn, options = dense_layer(name, ids)
                        y = jax.jit(fn, compiler_options=options)(x, ids[0], ws[0], *baseline_wts[name])
                    else:
                        f = jax.jit(lambda *a, cfg=cfg, impl=VARIANTS[name][0]: moe_experts_1bit(
                            *a, impl=impl, config=cfg, interpret=interpret, poison=True))
                        y = f(x, ids[0], ws[0], gu, dn)
                    err = rel_err(y, ref)
                    tol = 3e-2 if cfg is not None and cfg.compute == "mma_i8" else 2e-2  # int8 activations
                    ok = bool(np.isfinite(np.asarray(y, np.float32)).all() and err < tol)
                except Exception as ex:  # keep going: one broken variant must not kill the run
                    err, ok = float("nan"), False
                    log(f"! {name} P{planes} T{t}: {type(ex).__name__}: {str(ex)[:2000]}")
                    traceback.print_exc(limit=3)
                checks.append(dict(variant=name, planes=planes, tokens=t, rel_err=err, ok=ok))
                log(f"check {name:16s} P{planes} T{t:3d} rel_err {err:.2e} {'ok' if ok else 'FAIL'}")
        bad = {c["variant"] for c in checks if c["planes"] == planes and not c["ok"]}
        for t in tokens:
            if time.time() - t_start > args.budget_s:
                log(f"# time budget reached, skipping T={t} P{planes}")
                continue
            ids, ws = routings(rng, n_rot, t)
            xs = jax.random.normal(jax.random.PRNGKey(100 + t), (n_rot, t, HIDDEN), jnp.float32).astype(jnp.bfloat16)
            distinct = float(np.mean([len(np.unique(i)) for i in ids]))
            floor_s = distinct * bytes_per_expert / bw_copy
            row = dict(tokens=t, planes=planes, distinct_experts=distinct, bytes=distinct * bytes_per_expert,
                       floor_us=floor_s * 1e6, compute_floor_us=routed_flops(t) / rate * 1e6, times_us={})
            empty = make_scan(lambda x, i, w, *wts: x * jnp.bfloat16(1.001), args.iters, args.layers, args.unroll)
            te, _ = time_fn(empty, (xs, ids, ws, gu, dn), args.reps)
            row["loop_overhead_us"] = te / args.iters * 1e6
            for name in want:
                if name in bad or time.time() - t_start > args.budget_s + 60:
                    continue
                if name.startswith("pairs") and t > args.pairs_max_t:
                    continue
                if name.startswith("grouped") and t < args.grouped_min_t:
                    continue
                options = None
                if name in DENSE_BASELINES:
                    if baseline_wts[name] is None or not fits(name, t):
                        continue
                    fn, options = dense_layer(name, ids)
                    wts = baseline_wts[name]
                else:
                    impl, cfg = VARIANTS[name]
                    fn = functools.partial(moe_experts_1bit, impl=impl, config=cfg, interpret=interpret)
                    wts = (gu, dn)
                try:
                    tt, _ = time_fn(make_scan(fn, args.iters, args.layers, args.unroll, options), (xs, ids, ws, *wts),
                                    args.reps)
                    row["times_us"][name] = tt / args.iters * 1e6
                except Exception as ex:
                    log(f"! timing {name} P{planes} T{t}: {type(ex).__name__}: {str(ex)[:500]}")
            hpart = jax.random.normal(jax.random.PRNGKey(7), (t * TOPK, INTER), jnp.float32).astype(jnp.bfloat16)
            pnames = [f"{b}@{q}" for b in args.parts.split(",") if b and b != "prep"
                      for q in (("gu", "dn", "tab") if b.startswith("lut") else ("gu", "dn"))]
            pnames += ["grouped@prep"] if "prep" in args.parts.split(",") else []
            for pname in pnames:
                if planes != 1 or (t > args.pairs_max_t and pname.startswith("pairs")):
                    continue
                try:
                    tt, _ = time_fn(make_scan(part_fn(pname, interpret), args.iters, args.layers, args.unroll),
                                    (xs, ids, ws, gu, dn, hpart), args.reps)
                    row["times_us"][pname] = tt / args.iters * 1e6
                except Exception as ex:
                    log(f"! timing {pname} T{t}: {type(ex).__name__}: {str(ex)[:500]}")
            best = min(((k_, v_) for k_, v_ in row["times_us"].items() if "@" not in k_), default=("-", float("nan")),
                       key=lambda kv: kv[1])
            row["best"] = best[0]
            row["best_us"] = best[1]
            row["best_pct_of_floor"] = 100 * row["floor_us"] / best[1]
            # a part's share of the layer's FLOPs: gate_up 2/3, down 1/3 (the prep and the tables have none)
            share = {"": 1.0, "gu": 2 / 3, "dn": 1 / 3}
            row["pct_of_compute_floor"] = {k_: 100 * row["compute_floor_us"] * share[k_.partition("@")[2]] / v_
                                           for k_, v_ in row["times_us"].items() if k_.partition("@")[2] in share}
            row["best_pct_of_compute_floor"] = 100 * row["compute_floor_us"] / best[1]
            results.append(row)
            log("row " + json.dumps(row))
        del gu, dn, dense_wts, baseline_wts
    out = dict(info=info, checks=checks, results=results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    # short table last
    cols = [n for n in list(names) + sorted({k_ for r in results for k_ in r["times_us"] if "@" in k_})
            if any(n in r["times_us"] for r in results)]
    log("\nus per MoE layer (median); floor = distinct experts' bytes / copy bandwidth "
        f"({bw_copy / 1e9:.0f} GB/s); cfloor = routed experts' FLOPs / bf16 matmul rate ({rate / 1e12:.3g} TFLOP/s); "
        "loop = empty-scan overhead per iteration")
    widths = [max(8, len(c)) for c in cols]
    head = f"{'P':>1} {'T':>4} {'floor':>6} {'cfloor':>7} {'loop':>5} " + " ".join(
        f"{c:>{w}}" for c, w in zip(cols, widths))
    log(head + "  best(%floor, %cfloor)")
    for r in results:
        cells = " ".join(f"{r['times_us'].get(c, float('nan')):{w}.1f}" for c, w in zip(cols, widths))
        log(f"{r['planes']:>1} {r['tokens']:>4} {r['floor_us']:6.1f} {r['compute_floor_us']:7.1f} "
            f"{r['loop_overhead_us']:5.1f} {cells}  {r['best']}({r['best_pct_of_floor']:.0f}%, "
            f"{r['best_pct_of_compute_floor']:.0f}%)")
    log("\n% of the compute floor (a part: of its share, gate_up 2/3 and down 1/3)")
    log(f"{'P':>1} {'T':>4} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in results:
        cells = " ".join(f"{r['pct_of_compute_floor'].get(c, float('nan')):{w}.1f}" for c, w in zip(cols, widths))
        log(f"{r['planes']:>1} {r['tokens']:>4} {cells}")
    fails = [c for c in checks if not c["ok"]]
    log(f"checks: {len(checks) - len(fails)} ok, {len(fails)} failed " + " ".join(
        f"{c['variant']}/P{c['planes']}/T{c['tokens']}" for c in fails))
    return out


if __name__ == "__main__":
    main()
