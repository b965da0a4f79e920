"""Gated DeltaNet: projections (split or interleaved layout), causal conv, the gated delta rule (chunked for
prefill, recurrent for a few tokens), and the gated output norm."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from flax import struct

from pallas_kernels.activations import silu
from pallas_kernels.delta_chunk import chunk_scan
from pallas_kernels.delta_prep import chunk_prep
from pallas_kernels.delta_rule import gated_delta_conv_decode, gated_delta_decode, split_qkv
from strata_jax.model.config import ModelConfig
from strata_jax.model.cache import DeltaNetCache
from strata_jax.model.conv import advance_tail, causal_conv
from strata_jax.model.layers import DepthwiseConvWeight, GatedRMSNorm, Linear
from strata_jax.model.params import empty_param

CHUNK = 64
# Below this many tokens per call the token-by-token recurrence is cheaper than a padded 64-token chunk.
RECURRENT_MAX_TOKENS = 16


# The UT system's precision (its inverse and the two products through it): full float32 by default, since its
# errors compound over the chunk's 64 tokens; `bench --mode deltanet-prefill` measures the alternatives.
PREP_PRECISION = jax.lax.Precision.HIGHEST
# The scan over chunks when a call names none (`pallas_kernels.delta_chunk.IMPLS`); benchmarks set it per engine.
SCAN_IMPL = "auto"
# The UT system's inverse in diagonal blocks of this many tokens merged pairwise (`unit_lower_inverse_blocked`);
# 0: doubling over the whole chunk (`unit_lower_inverse`), the form before 2026-12-06. Measured faster on both:
# 8.4x for one layer's inverse on the CPU; the whole rule 1.21x on an H100, a 20,000-token prefill 5% (docs/PERF.md).
UT_BLOCK = 16
# The per-chunk part of a prefill chunk's rule: "jnp" (`chunk_prep_jnp`, XLA) or "pallas" (one kernel,
# `pallas_kernels.delta_prep`); benchmarks set it per engine.
PREP_IMPL = "jnp"


def _matmul(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    return jnp.matmul(a, b, precision=PREP_PRECISION if precision is None else precision)


def unit_lower_inverse(a: jax.Array, precision=None) -> jax.Array:
    """(I + A)^-1 for A [..., C, C] strictly lower triangular.

    A is nilpotent (A^C = 0), so the Neumann series I - A + A^2 - ... ends, and it folds into ceil(log2 C)
    doublings: (I - A)(I + A^2)(I + A^4)...: 2 log2(C) batched matmuls. XLA:CPU's triangular_solve (jaxlib 0.10.2)
    did the same per-chunk UT systems ~100x slower, over half of a demo prefill chunk on the 2-core CPU
    (docs/PERF.md, "On the 2-core CPU"); float32 results agree with it to 2e-8 against a float64 recurrence."""
    c = a.shape[-1]
    inverse = jnp.eye(c, dtype=a.dtype) - a
    power, covered = _matmul(a, a, precision), 2  # inverse holds the series' terms below A^covered
    while covered < c:
        inverse = inverse + _matmul(inverse, power, precision)
        covered *= 2
        if covered < c:
            power = _matmul(power, power, precision)
    return inverse


def unit_lower_inverse_blocked(a: jax.Array, block: int = 16, precision=None) -> jax.Array:
    """`unit_lower_inverse` (same result) by blocks: the diagonal [block, block] blocks inverted by doubling, then
    pairs of neighbouring inverses merged into ones twice their size, (I + A)^-1 of [[A11, 0], [A21, A22]] being
    [[X11, 0], [-X22 A21 X11, X22]]. For C = 64 that is ~20x fewer multiply-adds than doubling the whole chunk and
    far less memory traffic (the [C, C] arrays are only formed at the last merge). C must be `block` times a power
    of two, else (and for `block` <= 0) this is `unit_lower_inverse`."""
    c = a.shape[-1]
    m = c // block if block > 0 else 0
    if m < 2 or c % block or m & (m - 1):
        return unit_lower_inverse(a, precision)
    # Static slices, not a gather over a reshaped view: the gather form crashed XLA:CPU's compiler (jaxlib 0.10.2).
    def blocks(size: int, rows: range, offset: int) -> jax.Array:  # [..., len(rows), size, size]
        return jnp.stack([a[..., (i + offset) * size:(i + offset + 1) * size, i * size:(i + 1) * size]
                          for i in rows], axis=-3)

    inverse = unit_lower_inverse(blocks(block, range(m), 0), precision)  # [..., m, b, b]
    size = block
    while size < c:
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        below = blocks(size, range(0, c // size, 2), 1)  # A21 of each pair
        corner = -_matmul(_matmul(lower, below, precision), upper, precision)
        top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([corner, lower], axis=-1)], axis=-2)
        size *= 2
    return inverse[..., 0, :, :]


def chunk_prep_jnp(q, k, v, g, beta, chunk: int, precision=None, ut_block: int | None = None):
    """The chunked rule's per-chunk part, before the recurrence over chunks: q, k [B, T, H, Dk], v [B, T, H, Dv],
    g, beta [B, T, H] float32, T a multiple of `chunk` -> `delta_chunk.chunk_scan`'s inputs (u [B, H, N, C, Dv],
    w, q_dec, k_dec [B, H, N, C, Dk], intra [B, H, N, C, C], the chunks' decays [B, H, N]). The reference of
    `pallas_kernels.delta_prep.chunk_prep`."""
    b, t, h, _ = k.shape
    n = t // chunk
    # -> [B, H, N, C, ...]
    to_chunks = lambda a: jnp.moveaxis(a, 2, 1).reshape(b, h, n, chunk, *a.shape[3:])  # noqa: E731
    q, k, v, g, beta = (to_chunks(a) for a in (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    # (I + A) with A strictly lower: the UT system, applied through its inverse.
    a_mat = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0)
    block = UT_BLOCK if ut_block is None else ut_block
    inverse = unit_lower_inverse_blocked(a_mat, block, precision) if block else unit_lower_inverse(a_mat, precision)
    new_values = _matmul(inverse, v_beta, precision)
    k_cumdecay = _matmul(inverse, k_beta * jnp.exp(cum)[..., None], precision)
    intra = jnp.where(lower, jnp.einsum("...ik,...jk->...ij", q, k) * decay, 0.0)
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    return new_values, k_cumdecay, q_dec, k_dec, intra, jnp.exp(cum[..., -1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunk_prep_kernel(q, k, v, g, beta, chunk):
    b, t, h, _ = k.shape
    by_chunk = lambda a: jnp.moveaxis(a.reshape(b, t // chunk, chunk, h), 3, 1)  # noqa: E731  [B, H, N, C]
    cum = jnp.cumsum(by_chunk(g), axis=-1)
    outs = chunk_prep(q, k, v, cum, by_chunk(beta), chunk=chunk, interpret=jax.default_backend() != "gpu")
    return (*outs, jnp.exp(cum[..., -1]))


def _chunk_prep_kernel_fwd(q, k, v, g, beta, chunk):
    return _chunk_prep_kernel(q, k, v, g, beta, chunk), (q, k, v, g, beta)


def _chunk_prep_kernel_bwd(chunk, inputs, grads):
    # The kernel has no transpose: its gradient is the XLA form's (the demo trainer differentiates the model).
    _, vjp = jax.vjp(lambda *a: chunk_prep_jnp(*a, chunk), *inputs)
    return vjp(grads)


_chunk_prep_kernel.defvjp(_chunk_prep_kernel_fwd, _chunk_prep_kernel_bwd)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK, scan_impl: str | None = None,
                           precision=None, ut_block: int | None = None, prep_impl: str | None = None):
    """Chunked (UT-transform) gated delta rule continuing from `state`; same contract as the recurrent one
    (`pallas_kernels.delta_rule.recurrent_rule_jnp`; decode, verify and the replay run `gated_delta_decode`,
    that rule from the conv output, on a GPU a kernel that reads and writes the state once). The per-chunk part
    runs as `chunk_prep_jnp` or, with `prep_impl` (default `PREP_IMPL`) "pallas", as the kernel
    `pallas_kernels.delta_prep.chunk_prep` (its own dot precision and a doubled inverse; interpret mode off a GPU;
    the chunk a power of two of at least 16, as Dk and Dv). The sequential
    part over the chunks runs as `pallas_kernels.delta_chunk.chunk_scan`; `scan_impl` (default `SCAN_IMPL`): "auto"
    as `delta_chunk.resolve_impl` picks, "jnp" a loop over chunks, "states" a loop of the state's path alone,
    "assoc" a parallel prefix, "pallas" the kernel (in interpret mode off a GPU). `precision`: the UT system's
    matmuls (default `PREP_PRECISION`); `ut_block`: its inverse's diagonal blocks (default `UT_BLOCK`; 0: doubling
    over the whole chunk)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        padding = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        q, k, v, g, beta = (padding(a) for a in (q, k, v, g, beta))
    n = (t + pad) // chunk
    if (prep_impl or PREP_IMPL) == "pallas":
        prepared = _chunk_prep_kernel(q, k, v, g, beta, chunk)
    else:
        prepared = chunk_prep_jnp(q, k, v, g, beta, chunk, precision, ut_block)
    out, state = chunk_scan(*prepared, state, impl=scan_impl or SCAN_IMPL, interpret=jax.default_backend() != "gpu")
    out = out.reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(out, 1, 2), state


@struct.dataclass
class DeltaNetReplay:
    """What a verify pass keeps so the state can be rebuilt for any accepted prefix without re-running the layer:
    the conv input, the activated conv output (q | k | v) and the recurrence's per-token decay and beta."""

    conv_in: jax.Array  # [B, T, conv_dim]
    qkv: jax.Array  # [B, T, conv_dim]
    g: jax.Array  # [B, T, Hv]
    beta: jax.Array  # [B, T, Hv]
    k_heads: int = struct.field(pytree_node=False)


def replay_deltanet(before: DeltaNetCache, replay: DeltaNetReplay, n_keep: jax.Array) -> DeltaNetCache:
    """The cache as if only the first `n_keep[b]` tokens of the replayed window had been fed."""
    t = replay.qkv.shape[1]
    keep = (jnp.arange(t)[None, :] < n_keep[:, None])[..., None]
    _, state = gated_delta_decode(replay.qkv, jnp.where(keep, replay.g, 0.0), jnp.where(keep, replay.beta, 0.0),
                                  before.state, k_heads=replay.k_heads)
    return DeltaNetCache(conv=advance_tail(before.conv, replay.conv_in, n_keep), state=state)


class GatedDeltaNet(nnx.Module):
    """Linear-attention token mixer of 3 in 4 layers."""

    # `strata_jax.model.decoder.enable_fused_decode`: calls of at most RECURRENT_MAX_TOKENS tokens run the conv and
    # the delta rule as one kernel on a GPU (`gated_delta_conv_decode`).
    fused_decode = False

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        h = cfg.hidden_size
        self.cfg = cfg
        self.key_dim = cfg.linear_num_k_heads * cfg.linear_k_dim
        self.value_dim = cfg.linear_num_v_heads * cfg.linear_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if cfg.gdn_split_projections:
            self.in_proj_qkv = Linear(h, self.conv_dim, dtype)
            self.in_proj_z = Linear(h, self.value_dim, dtype)
            self.in_proj_b = Linear(h, cfg.linear_num_v_heads, dtype)
            self.in_proj_a = Linear(h, cfg.linear_num_v_heads, dtype)
        else:
            self.in_proj_qkvz = Linear(h, self.conv_dim + self.value_dim, dtype)
            self.in_proj_ba = Linear(h, 2 * cfg.linear_num_v_heads, dtype)
        self.conv1d = DepthwiseConvWeight(self.conv_dim, cfg.linear_conv_kernel, dtype)
        self.dt_bias = empty_param((cfg.linear_num_v_heads,), dtype)
        self.A_log = empty_param((cfg.linear_num_v_heads,), dtype)
        self.norm = GatedRMSNorm(cfg.linear_v_dim, cfg.rms_norm_eps, dtype, cfg.gdn_gate_act)
        self.out_proj = Linear(self.value_dim, h, dtype)

    def _project(self, x: jax.Array):
        """Returns mixed qkv [B,T,conv_dim] (channel order q|k|v), z [B,T,Hv,Dv], b and a [B,T,Hv]."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        hv, dv = cfg.linear_num_v_heads, cfg.linear_v_dim
        if cfg.gdn_split_projections:
            qkv = self.in_proj_qkv(x)
            z = self.in_proj_z(x).reshape(bsz, t, hv, dv)
            return qkv, z, self.in_proj_b(x), self.in_proj_a(x)
        # Interleaved layout: per key head, [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)].
        hk, dk = cfg.linear_num_k_heads, cfg.linear_k_dim
        r = hv // hk
        qkvz = self.in_proj_qkvz(x).reshape(bsz, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(bsz, t, hk, 2 * r)
        b, a = ba[..., :r].reshape(bsz, t, hv), ba[..., r:].reshape(bsz, t, hv)
        flat = lambda y: y.reshape(bsz, t, -1)  # noqa: E731
        qkv = jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1)
        return qkv, z.reshape(bsz, t, hv, dv), b, a

    def __call__(
        self, x: jax.Array, cache: DeltaNetCache, n_valid: jax.Array, with_replay: bool = False
    ) -> tuple[jax.Array, DeltaNetCache, DeltaNetReplay | None]:
        """Returns the output, the cache after the first n_valid tokens and (with_replay) the replay inputs."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        qkv_in, z, b, a = self._project(x)
        hk, hv = cfg.linear_num_k_heads, cfg.linear_num_v_heads
        valid = (jnp.arange(t)[None, :] < n_valid[:, None])[..., None]
        # Padded tokens get beta = 0 and no decay, so they leave the recurrent state untouched.
        beta = jnp.where(valid, jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        g = jnp.where(valid, g, 0.0)
        if self.fused_decode and t <= RECURRENT_MAX_TOKENS:  # conv, activation and rule: one kernel on a GPU
            out, qkv, conv_state, state = gated_delta_conv_decode(qkv_in, cache.conv, self.conv1d.kernel(), g, beta,
                                                                  cache.state, n_valid, k_heads=hk)
        else:
            conv_out, conv_state = causal_conv(qkv_in, cache.conv, self.conv1d.kernel(), n_valid)
            qkv = silu(conv_out.astype(jnp.float32)).astype(x.dtype)
            if t <= RECURRENT_MAX_TOKENS:
                out, state = gated_delta_decode(qkv, g, beta, cache.state, k_heads=hk)
            else:
                q, k, v = split_qkv(qkv, hk, hv, cfg.linear_k_dim, cfg.linear_v_dim)
                out, state = chunk_gated_delta_rule(q, k, v, g, beta, cache.state)
        out = self.norm(out.astype(x.dtype), z)
        out = self.out_proj(out.reshape(bsz, t, -1))
        replay = DeltaNetReplay(conv_in=qkv_in, qkv=qkv, g=g, beta=beta, k_heads=hk) if with_replay else None
        return out, DeltaNetCache(conv=conv_state, state=state), replay
