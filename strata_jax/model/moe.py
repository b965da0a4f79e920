"""Sparse MoE block: softmax router, top-k (renormalised), routed experts and a sigmoid-gated shared expert.

Packed experts may be split between a fixed-size device pool and the host (`ExpertQuantization.gpu_experts`):
see `QuantizedExperts` and docs/FORMATS.md, "Host tier". The host's compute is handed in (`HostExperts`): this
module imports nothing of `strata_jax.host`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from pallas_kernels import PackedExperts, moe_experts_1bit
from pallas_kernels.activations import silu
from pallas_kernels.expert_blocks import experts_by_blocks, run_sorted_by_expert
from pallas_kernels.fused_router import MAX_TOKENS as FUSED_MAX_TOKENS
from pallas_kernels.fused_router import fused_route
from pallas_kernels.fused_matvec import fused_matvec
from strata_jax.model.config import ExpertQuantization, ModelConfig
from strata_jax.model.expert_stream import STAT_NAMES, RowLayout, streamed_experts, to_host_memory
from strata_jax.model.expert_parallel import run_experts
from strata_jax.model.layers import MLP, Linear
from strata_jax.model.params import empty_param


class HostExperts(Protocol):
    """What a `QuantizedExperts` layer with a device pool needs from the host (`strata_jax.host.tier.HostTier`):
    every expert's packed arrays in host memory, rows of them for the pool, and the callback for host pairs. Array
    names are "gate_up_bits", "gate_up_scales", "down_bits", "down_scales", in the checkpoint's layout."""

    def set(self, name: str, array: np.ndarray) -> None:
        """Sets one array of all E experts."""

    def rows(self, name: str, experts: np.ndarray) -> np.ndarray:
        """Experts' rows of one array, as `set` took it (placement copies them into the pool)."""

    def compute(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """sum over mask[t, j] of weights[t, j] * expert ids[t, j] (x[t]) -> float32 [T, H]."""

    def warm_up(self, max_rows: int) -> None:
        """Prepares the host kernels for up to `max_rows` rows per expert."""


# Builds one layer's `HostExperts` from its scale group; called for every layer that has a device pool.
HostExpertsFactory = Callable[[int], HostExperts]


class ExpertSlots(nnx.Variable):
    """int32 [E]: the device pool slot of each expert, -1 for experts computed on the host."""


def _initial_slots(num_experts: int, pool: int) -> jax.Array:
    """Experts 0..pool-1 in slots 0..pool-1, the others on the host."""
    e = jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.where(e < pool, e, -1)


class RoutingCounts(nnx.Variable):
    """int32 [E]: routed (real token, expert) pairs per expert since the engine last read and cleared them."""


class StreamCounts(RoutingCounts):
    """int32 [3]: a streaming layer's counters since the engine last read them (`expert_stream.STAT_NAMES`: experts
    staged, rows copied, rounds). A kind of `RoutingCounts`, so that every step returns them with the counts."""


class HostExpertRows(nnx.Variable):
    """uint32 [E, words]: every expert's packed row in pinned host memory (`expert_stream.RowLayout`); not a
    `nnx.Param`, so the planner counts none of it as device weights."""


# Standard deviation of the Gumbel distribution: standardized logits times this, plus log p, select experts
# roughly as sampling k of them from p without replacement (the Gumbel-top-k trick with Gaussian noise).
_GUMBEL_STD = 1.2825


def route(
    logits: jax.Array, top_k: int, normalize: bool, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] -> (expert ids [N, k] int32, weights [N, k] float32).

    `bias` [E] (benchmarks only, see `RoutingBias`) changes which experts are selected, not their weights: the
    selection score is the token's standardized logits x 1.28 + bias, so bias = log p routes like a sample from p."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if bias is None:
        weights, ids = jax.lax.top_k(probs, top_k)
    else:
        lf = logits.astype(jnp.float32)
        z = (lf - lf.mean(-1, keepdims=True)) / (lf.std(-1, keepdims=True) + 1e-6)
        _, ids = jax.lax.top_k(z * _GUMBEL_STD + bias.astype(jnp.float32), top_k)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def experts_reference(
    x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array
) -> jax.Array:
    """Routed experts on dense weights: sum_k w_k * down_e(silu(gate_e x) * up_e x).

    x [N, H]; ids/weights [N, k]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]. Few tokens gather
    their experts' weights; many tokens are sorted by expert and run as one grouped (ragged) matmul.
    """
    n, k = ids.shape
    n_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    xw = x.astype(gate_up.dtype)
    if n * k <= n_experts:
        gu = jnp.einsum("nh,nkoh->nko", xw, gate_up[ids])
        act = silu(gu[..., :inter]) * gu[..., inter:]
        out = jnp.einsum("nki,nkhi->nkh", act, down[ids])
        return jnp.einsum("nkh,nk->nh", out.astype(jnp.float32), weights).astype(x.dtype)

    def grouped(xs, sizes):
        gu = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), sizes)
        act = (silu(gu[:, :inter]) * gu[:, inter:]).astype(down.dtype)
        return jax.lax.ragged_dot(act, jnp.swapaxes(down, 1, 2), sizes).astype(jnp.float32)

    def blocks(xs, sizes):  # XLA:CPU's ragged_dot is a dense product over every expert
        return experts_by_blocks(xs, sizes, lambda e: (gate_up[e], down[e]), n_experts)

    run = grouped if jax.default_backend() == "gpu" else blocks
    return run_sorted_by_expert(xw, ids, weights, n_experts, run).astype(x.dtype)


class Experts(nnx.Module):
    """Routed expert weights, fused as in HF: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = empty_param((e, 2 * i, h), dtype)
        self.down_proj = empty_param((e, h, i), dtype)

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """`valid` (bool [N], the real tokens) is accepted for the packed experts' interface; dense experts compute
        every row."""
        return experts_reference(x, ids, weights, self.gate_up_proj[...], self.down_proj[...])


class QuantizedExperts(nnx.Module):
    """Routed experts as packed sign bit-planes + bf16 group scales, multiplied by `pallas_kernels`.

    With `quant.gpu_experts` below the number of experts, the four arrays hold a device pool of that many expert
    slots and `slot_of` maps experts to slots (-1: outside the pool). `quant.host_path` says how the others
    are served: "compute": `host` (built by `host_experts`) keeps every expert's packed bytes in host memory and a
    step runs the pool's pairs through the kernel (host pairs weighted 0 there) and all host pairs of the layer
    through one host callback; "stream": `host_rows` keeps every expert's packed row in pinned host memory and the
    step copies the missing ones to the device and runs them through the kernel (`expert_stream`; `host`, when the
    loader built one, stays empty). Either way routing per expert is counted in `counts` (for hot-expert
    placement). Without a pool the code path is exactly the all-on-device one."""

    def __init__(self, cfg: ModelConfig, quant: ExpertQuantization, host_experts: HostExpertsFactory | None = None):
        e, i, h, p, g = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, quant.planes, quant.group
        self.quant = quant
        self.num_experts = e
        pool = e if quant.gpu_experts is None else min(e, quant.gpu_experts)
        self.pool_size = pool
        self.gate_up_bits = empty_param((pool, p, h // 32, 2 * i), jnp.uint32)
        self.gate_up_scales = empty_param((pool, p, -(-h // g), 2 * i), jnp.bfloat16)
        self.down_bits = empty_param((pool, p, i // 32, h), jnp.uint32)
        self.down_scales = empty_param((pool, p, -(-i // g), h), jnp.bfloat16)
        self.streaming = pool < e and quant.host_path == "stream"
        if pool < e and host_experts is None and not self.streaming:
            raise ValueError(f"{pool} of {e} experts in the device pool: the others need host_experts")
        self.host = host_experts(g) if pool < e and host_experts is not None else None
        if pool < e:
            self.slot_of = ExpertSlots(_initial_slots(e, pool))
            self.counts = RoutingCounts(jnp.zeros((e,), jnp.int32))
        if self.streaming:
            self.layout = RowLayout.of(h, i, p, g)
            self.host_rows = HostExpertRows(jnp.zeros((e, self.layout.words), jnp.uint32))
            self.streamed = StreamCounts(jnp.zeros((len(STAT_NAMES),), jnp.int32))
            self.rows_loaded = frozenset()  # kinds packed into host_rows so far (`load`)

    @property
    def tiered(self) -> bool:
        """Whether some experts live outside the device pool (computed on the host or streamed)."""
        return self.pool_size < self.num_experts

    def load(self, kind: str, bits, scales) -> None:
        """Sets `kind` ("gate_up" / "down") from all E experts' packed numpy arrays: the whole stack on the device,
        or, with a host tier, every expert kept on the host and the initial pool (experts 0..pool-1) on the device.
        Streaming, each kind is packed into the rows as it comes, which move to pinned host memory once both have."""
        if not self.tiered:
            getattr(self, f"{kind}_bits").set_value(jnp.asarray(bits))
            getattr(self, f"{kind}_scales").set_value(jnp.asarray(scales))
            return
        bits, scales = np.asarray(bits), np.asarray(scales)
        if scales.dtype != ml_dtypes.bfloat16:
            scales = scales.astype(ml_dtypes.bfloat16)
        if self.streaming:
            self._pack_rows(kind, bits, scales)
        else:
            self.host.set(f"{kind}_bits", bits)
            self.host.set(f"{kind}_scales", scales)
        getattr(self, f"{kind}_bits").set_value(jnp.asarray(bits[: self.pool_size]))
        getattr(self, f"{kind}_scales").set_value(jnp.asarray(scales[: self.pool_size]))
        # Built abstractly (nnx.eval_shape) like the parameters: make the map and the counters concrete too.
        e = self.num_experts
        self.slot_of.set_value(_initial_slots(e, self.pool_size))
        self.counts.set_value(jnp.zeros((e,), jnp.int32))

    def _pack_rows(self, kind: str, bits: np.ndarray, scales: np.ndarray) -> None:
        rows = self.host_rows.get_value()
        if not isinstance(rows, np.ndarray):  # abstract or already on the host memory: (re)build from scratch
            rows = np.zeros((self.num_experts, self.layout.words), np.uint32)
            self.rows_loaded = frozenset()
        self.layout.pack_part(rows, f"{kind}_bits", bits)
        self.layout.pack_part(rows, f"{kind}_scales", scales)
        self.rows_loaded = self.rows_loaded | {kind}
        if self.rows_loaded == {"gate_up", "down"}:
            self.host_rows.set_value(to_host_memory(rows, memory=self.quant.host_memory))
            self.streamed.set_value(jnp.zeros((len(STAT_NAMES),), jnp.int32))
        else:  # a numpy buffer until the other kind arrives
            self.host_rows.set_value(rows)

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """x [N, H], ids/weights [N, k]; `valid` (bool [N], default all) marks the real tokens: padding and idle
        slots neither count as routing nor cost host work."""
        g = self.quant.group
        gate_up = PackedExperts(self.gate_up_bits[...], self.gate_up_scales[...], g)
        down = PackedExperts(self.down_bits[...], self.down_scales[...], g)
        if not self.tiered:
            return moe_experts_1bit(x, ids, weights, gate_up, down, impl=self.quant.impl)
        if valid is None:
            valid = jnp.ones((x.shape[0],), bool)
        self.counts[...] = self.counts[...] + jnp.zeros((self.num_experts,), jnp.int32).at[ids].add(
            jnp.broadcast_to(valid[:, None], ids.shape).astype(jnp.int32))
        if self.streaming:
            q = self.quant
            out, stats = streamed_experts(x, ids, weights, valid, self.slot_of[...], gate_up, down,
                                          self.host_rows[...], self.layout, copy_slots=q.copy_slots,
                                          prefill_copy_slots=q.prefill_copy_slots, impl=q.impl,
                                          copy_impl=q.stream_copy)
            self.streamed[...] = self.streamed[...] + stats
            return out
        slot = self.slot_of[...][ids]
        on_device = slot >= 0
        device = moe_experts_1bit(x, jnp.where(on_device, slot, 0), jnp.where(on_device, weights, 0.0), gate_up,
                                  down, impl=self.quant.impl)
        on_host = ~on_device & valid[:, None]
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)

        def host_pairs():
            return jax.pure_callback(self.host.compute, out, x.astype(jnp.float32), ids, weights.astype(jnp.float32),
                                     on_host, vmap_method="sequential")

        # The round trip (~330 us on the GPU probe) only when a pair of this layer is on the host.
        host = jax.lax.cond(jnp.any(on_host), host_pairs, lambda: jnp.zeros(x.shape, jnp.float32))
        return (device.astype(jnp.float32) + host).astype(x.dtype)


class RoutingBias(nnx.Variable):
    """float32 [E]: an optional selection bias of a `Router` (see `route`). No checkpoint has one: benchmarks attach
    it (`add_routing_bias`) to give synthetic weights a skewed (e.g. Zipf) routing; changing it never recompiles."""


def add_routing_bias(model: nnx.Module) -> int:
    """Attaches a zero `RoutingBias` to every MoE router of `model`; returns how many."""
    routers = [node for _, node in nnx.iter_graph(model) if isinstance(node, Router)]
    for router in routers:
        router.bias = RoutingBias(jnp.zeros((router.weight.shape[0],), jnp.float32))
    return len(routers)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        self.weight = empty_param((cfg.num_experts, cfg.hidden_size), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("nh,eh->ne", x.astype(self.weight.dtype), self.weight[...])


class SparseMoe(nnx.Module):
    # `strata_jax.model.decoder.enable_fused_decode`: calls of at most FUSED_MAX_TOKENS tokens run the router and
    # the shared expert through the fused kernels on a GPU.
    fused_decode = False

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, quant: ExpertQuantization | None = None,
                 host_experts: HostExpertsFactory | None = None):
        self.cfg = cfg
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype) if quant is None else QuantizedExperts(cfg, quant, host_experts)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype)

    def __call__(self, x: jax.Array, real: jax.Array | None = None) -> jax.Array:
        """x [B, T, H] (or [N, H]); `real` (bool, x's leading shape) marks the real tokens (default: all)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        bias = self.gate.bias[...] if hasattr(self.gate, "bias") else None
        fused = self.fused_decode and flat.shape[0] <= FUSED_MAX_TOKENS
        if fused and bias is None:
            ids, weights = fused_route(flat, self.gate.weight[...], self.cfg.num_experts_per_tok,
                                       self.cfg.norm_topk_prob)
        else:
            ids, weights = route(self.gate(flat), self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob, bias)
        # A plain call unless the step runs expert parallel over a mesh (strata_jax/model/expert_parallel.py).
        routed = run_experts(self.experts, flat, ids, weights, None if real is None else real.reshape(-1))
        if fused:  # the shared expert as two kernels: the gated product, then down + its gate + the routed sum
            mlp = self.shared_expert
            act = fused_matvec(flat, mlp.gate_proj.weight[...], up=mlp.up_proj.weight[...])
            out = fused_matvec(act, mlp.down_proj.weight[...], gate=(flat, self.shared_expert_gate.weight[...]),
                               residual=routed)
            return out.reshape(shape)
        shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(shape)

