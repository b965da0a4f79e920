"""A few tokens of the gated delta rule (Gated DeltaNet decode and verify), as a Pallas kernel beside its jnp form.

For every (batch, value head) with state ``S [Dk, Dv]`` and each token in turn::

    S   <- S * exp(g)
    S   <- S + k (x) ((v - S^T k) * beta)
    out  = S^T q

The jnp form reads the state twice per token: XLA makes ``S^T k`` one reduction fusion and the update plus
``S^T q`` another. At 32 slots the state is 100 MB per layer, so the decode update ran at ~1.5 TB/s of state
traffic (docs/PERF.md). Here one program owns a ``[Dk, block_v]`` column block of one head's state and keeps it in
registers across all T tokens: one read and one write of the state per call, written in place (the new state
aliases the old one, so a jit that donates the cache needs no second buffer).

The kernel starts from the layer's activated conv output (channels ``q | k | v``) rather than from prepared q, k, v:
splitting, the per-head L2 normalisation, q's scale and the sharing of a key head by several value heads all
happen in registers. At decode each of those was its own small XLA kernel, and at 1-32 slots a step's time goes
as much to launches as to bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

IMPLS = ("auto", "jnp", "pallas")
L2_EPS = 1e-6


def l2norm(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def split_qkv(qkv: jax.Array, k_heads: int, v_heads: int, k_dim: int, v_dim: int):
    """The conv output [B, T, 2*Hk*Dk + Hv*Dv] -> q, k [B, T, Hv, Dk] (L2-normalised, q scaled by Dk^-0.5, each key
    head repeated for its Hv/Hk value heads) and v [B, T, Hv, Dv], all float32."""
    bsz, t, _ = qkv.shape
    key_dim = k_heads * k_dim
    q, k, v = jnp.split(qkv.astype(jnp.float32), [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(bsz, t, k_heads, k_dim)
    k = k.reshape(bsz, t, k_heads, k_dim)
    if v_heads != k_heads:
        q = jnp.repeat(q, v_heads // k_heads, axis=2)
        k = jnp.repeat(k, v_heads // k_heads, axis=2)
    return l2norm(q) * k_dim**-0.5, l2norm(k), v.reshape(bsz, t, v_heads, v_dim)


def recurrent_rule_jnp(q, k, v, g, beta, state):
    """Token-by-token gated delta rule. q, k [B, T, H, Dk] (normalised, q scaled), v [B, T, H, Dv], g, beta
    [B, T, H], state [B, H, Dk, Dv]; all float32. Returns (out [B, T, H, Dv], final state).

    Reductions over Dk are written as multiply + sum, not einsum: a dot_general over the state's second-minor axis
    makes XLA transpose the whole state first (80 us per layer at 32 slots on an H200), while a column reduction
    reads it in place and fuses with the decay."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.sum(s * k_t[..., :, None], axis=-2)
        s = s + k_t[..., :, None] * ((v_t - kv_mem) * b_t[..., None])[..., None, :]
        return s, jnp.sum(s * q_t[..., :, None], axis=-2)

    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1), state


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def resolve_impl(impl: str, dk: int, dv: int) -> str:
    """"auto": the Pallas kernel on a GPU when the head dims are powers of two (a Triton block constraint)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and _is_pow2(dk) and _is_pow2(dv) else "jnp"
    return impl


def _kernel(qkv_ref, gb_ref, s_ref, o_ref, s_out_ref, *, tokens, v_heads, group, k_dim, v_dim, block_v):
    key_dim = v_heads // group * k_dim
    row = pl.program_id(0)
    b, h = row // v_heads, row % v_heads
    kh = h // group  # the key head this value head shares
    c0 = pl.program_id(1) * block_v
    cols = pl.ds(c0, block_v)
    s = s_ref[row, :, cols]  # [Dk, block_v] float32
    for t in range(tokens):  # T is small and static: unrolled, the state never leaves registers
        q = qkv_ref[b, t, pl.ds(kh * k_dim, k_dim)].astype(jnp.float32)
        k = qkv_ref[b, t, pl.ds(key_dim + kh * k_dim, k_dim)].astype(jnp.float32)
        v = qkv_ref[b, t, pl.ds(2 * key_dim + h * v_dim + c0, block_v)].astype(jnp.float32)
        q = q * (jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * k_dim**-0.5)
        k = (k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS))[:, None]
        s = s * jnp.exp(gb_ref[b, t, h, 0])
        delta = (v - jnp.sum(s * k, axis=0)) * gb_ref[b, t, h, 1]
        s = s + k * delta[None, :]
        o_ref[b, t, h, cols] = jnp.sum(s * q[:, None], axis=0)
    s_out_ref[row, :, cols] = s


def default_block_v(tokens: int) -> int:
    """State columns per program: 64 for one token, 32 for more, the fastest of 16-128 measured on the H200 at
    Flash-Next's shapes (docs/PERF.md, "Gated DeltaNet decode kernel")."""
    return 64 if tokens == 1 else 32


def gated_delta_decode(qkv, g, beta, state, *, k_heads: int, impl: str = "auto", block_v: int | None = None,
                       num_warps: int = 4, interpret: bool = False):
    """The gated delta rule over T tokens, from the layer's activated conv output.

    qkv [B, T, 2*Hk*Dk + Hv*Dv] (channels q | k | v, any float dtype), g, beta [B, T, Hv] float32, state
    [B, Hv, Dk, Dv] float32 -> (out [B, T, Hv, Dv] float32, new state). Equals
    ``recurrent_rule_jnp(*split_qkv(qkv, ...), g, beta, state)``, which is what ``impl="jnp"`` runs.

    ``impl``: "jnp", "pallas" or "auto" (``resolve_impl``); ``block_v`` defaults to ``default_block_v(T)``. T is
    unrolled inside the kernel, so keep it small (decode and speculative verify); long prompts belong to the
    chunked form."""
    bsz, t, channels = qkv.shape
    _, v_heads, k_dim, v_dim = state.shape
    if channels != 2 * k_heads * k_dim + v_heads * v_dim or v_heads % k_heads:
        raise ValueError(f"qkv has {channels} channels; {k_heads} key heads of {k_dim} and {v_heads} value heads of "
                         f"{v_dim} need {2 * k_heads * k_dim + v_heads * v_dim} (and Hv a multiple of Hk)")
    if resolve_impl(impl, k_dim, v_dim) == "jnp":
        return recurrent_rule_jnp(*split_qkv(qkv, k_heads, v_heads, k_dim, v_dim), g, beta, state)
    bv = min(block_v or default_block_v(t), v_dim)
    if not (_is_pow2(k_dim) and _is_pow2(bv) and v_dim % bv == 0):
        raise ValueError(f"the Pallas delta rule needs a power-of-two Dk and a power-of-two block_v dividing Dv, "
                         f"got Dk={k_dim}, Dv={v_dim}, block_v={bv}")
    f32 = jnp.float32
    # g and beta travel as one array: XLA then computes both in one fusion instead of two.
    gb = jnp.stack([g.astype(f32), beta.astype(f32)], axis=-1)
    kernel = functools.partial(_kernel, tokens=t, v_heads=v_heads, group=v_heads // k_heads, k_dim=k_dim,
                               v_dim=v_dim, block_v=bv)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=1)}
    out, new_state = pl.pallas_call(
        kernel,
        grid=(bsz * v_heads, v_dim // bv),
        out_shape=(jax.ShapeDtypeStruct((bsz, t, v_heads, v_dim), f32),
                   jax.ShapeDtypeStruct((bsz * v_heads, k_dim, v_dim), f32)),
        input_output_aliases={2: 1},
        interpret=interpret,
        **kwargs,
    )(qkv, gb, state.astype(f32).reshape(bsz * v_heads, k_dim, v_dim))
    return out, new_state.reshape(state.shape)
