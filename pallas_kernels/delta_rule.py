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


def is_pow2(n: int) -> bool:
    """Whether n is a positive power of two (Triton block sides must be)."""
    return n > 0 and n & (n - 1) == 0


def resolve_impl(impl: str, dk: int, dv: int) -> str:
    """"auto": the Pallas kernel on a GPU when the head dims are powers of two (a Triton block constraint)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and is_pow2(dk) and is_pow2(dv) else "jnp"
    return impl


def _rule_token(s, q, k, v, gb_ref, o_ref, b, t, h, cols, k_dim):
    """One token of the gated delta rule on a program's state block `s` [Dk, block_v] (float32): L2-normalised q and
    k, decay, delta update, output row written to `o_ref`; returns the new state."""
    q = q * (jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * k_dim**-0.5)
    k = (k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS))[:, None]
    s = s * jnp.exp(gb_ref[b, t, h, 0])
    delta = (v - jnp.sum(s * k, axis=0)) * gb_ref[b, t, h, 1]
    s = s + k * delta[None, :]
    o_ref[b, t, h, cols] = jnp.sum(s * q[:, None], axis=0)
    return s


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
        s = _rule_token(s, q, k, v, gb_ref, o_ref, b, t, h, cols, k_dim)
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
    if not (is_pow2(k_dim) and is_pow2(bv) and v_dim % bv == 0):
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


# --- The causal conv folded in (issue 23, item 1, step 3) ---------------------------------------------------------
#
# `gated_delta_conv_decode` starts one step earlier, from the layer's raw projection qkv_in [B, T, C] and the conv
# tail [B, C, L]: each program computes the depthwise conv (+ SiLU) of the channels it needs (its key head's q and k,
# its value columns) for every token from the tail and the raw inputs, runs the rule, and writes the activated conv
# output (the verify replay needs it) and the conv tail after the first n_valid tokens. q and k are recomputed by
# every program of the key head (2 x Dk x kernel multiply-adds per token, nothing next to the state); the program
# of value column block 0 of the first value head of a key head writes them. XLA's conv, its activation and the
# tail's dynamic slice (two to three kernels per layer at decode) go. The gated output norm stays outside: it
# needs a whole value head's output, which is spread over Dv / block_v programs.


def causal_conv_jnp(x, conv_state, weight, n_valid):
    """The model's depthwise causal conv (`strata_jax.model.conv.causal_conv`) with its SiLU, op for op: x [B, T, C],
    conv_state [B, C, L], weight [C, L+1], n_valid [B] -> (silu(conv) [B, T, C] in x.dtype, the tail after the first
    n_valid[b] inputs)."""
    kernel, tail, t = weight.shape[-1], conv_state.shape[-1], x.shape[1]
    xs = jnp.concatenate([conv_state, jnp.swapaxes(x, 1, 2).astype(conv_state.dtype)], axis=-1)
    w = weight.astype(jnp.float32)
    out = jnp.zeros(x.shape[:1] + (weight.shape[0], t), jnp.float32)
    for k in range(kernel):
        out = out + w[None, :, k : k + 1] * xs[:, :, k : k + t].astype(jnp.float32)
    conv = jnp.swapaxes(out, 1, 2).astype(x.dtype)
    new_tail = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, tail, axis=-1))(xs, n_valid)
    qkv = (conv.astype(jnp.float32) / (1.0 + jnp.exp(-conv.astype(jnp.float32)))).astype(x.dtype)
    return qkv, new_tail


def _conv_kernel(x_ref, cs_ref, w_ref, gb_ref, n_ref, s_ref, o_ref, qkv_ref, cs_out_ref, s_out_ref, *, tokens,
                 v_heads, group, k_dim, v_dim, block_v, kernel):
    f32, tail = jnp.float32, kernel - 1
    key_dim = v_heads // group * k_dim
    row = pl.program_id(0)
    b, h = row // v_heads, row % v_heads
    kh = h // group
    c0 = pl.program_id(1) * block_v
    writes_qk = (h % group == 0) & (pl.program_id(1) == 0)
    channels = {"q": (kh * k_dim, k_dim), "k": (key_dim + kh * k_dim, k_dim),
                "v": (2 * key_dim + h * v_dim + c0, block_v)}

    def window(ch0, n, i):  # input i of [tail | the T new inputs] for channels ch0 .. ch0+n, float32
        if i < tail:
            return cs_ref[b, pl.ds(ch0, n), i].astype(f32)
        return x_ref[b, i - tail, pl.ds(ch0, n)].astype(cs_ref.dtype).astype(f32)

    def conv_silu(name, t):
        ch0, n = channels[name]
        acc = jnp.zeros((n,), f32)
        for j in range(kernel):  # the reference's order of sums
            acc = acc + w_ref[pl.ds(ch0, n), j].astype(f32) * window(ch0, n, t + j)
        c = acc.astype(x_ref.dtype).astype(f32)
        act = (c / (1.0 + jnp.exp(-c))).astype(qkv_ref.dtype)
        if name == "v":
            qkv_ref[b, t, pl.ds(ch0, n)] = act
        else:
            @pl.when(writes_qk)
            def _():
                qkv_ref[b, t, pl.ds(ch0, n)] = act
        return act.astype(f32)

    cols = pl.ds(c0, block_v)
    s = s_ref[row, :, cols]
    for t in range(tokens):
        q, k, v = conv_silu("q", t), conv_silu("k", t), conv_silu("v", t)
        s = _rule_token(s, q, k, v, gb_ref, o_ref, b, t, h, cols, k_dim)
    s_out_ref[row, :, cols] = s

    def write_tail(name):
        ch0, n = channels[name]
        for j in range(tail):  # the tail after n_valid inputs: [old tail | inputs][n_valid + j]
            src = n_ref[b] + j
            old = cs_ref[b, pl.ds(ch0, n), jnp.minimum(src, tail - 1)]
            new = x_ref[b, jnp.clip(src - tail, 0, tokens - 1), pl.ds(ch0, n)].astype(cs_out_ref.dtype)
            cs_out_ref[b, pl.ds(ch0, n), j] = jnp.where(src < tail, old, new)

    write_tail("v")

    @pl.when(writes_qk)
    def _():
        write_tail("q")
        write_tail("k")


def gated_delta_conv_decode(qkv_in, conv_state, conv_weight, g, beta, state, n_valid, *, k_heads: int,
                            impl: str = "auto", block_v: int | None = None, num_warps: int = 4,
                            interpret: bool = False):
    """The causal conv, its SiLU and the gated delta rule over T tokens, from the layer's raw projection.

    qkv_in [B, T, C] (channels q | k | v, C = 2*Hk*Dk + Hv*Dv), conv_state [B, C, L] (the conv's tail), conv_weight
    [C, L+1], g, beta [B, T, Hv] float32 (0 for padding tokens), state [B, Hv, Dk, Dv] float32, n_valid [B] int32 ->
    (out [B, T, Hv, Dv] float32, the activated conv output [B, T, C] in qkv_in.dtype, the conv tail after the first
    n_valid[b] tokens, the new state). Equals ``causal_conv_jnp`` then ``gated_delta_decode``, which is what
    ``impl="jnp"`` runs; ``impl``, ``block_v``, ``num_warps`` and ``interpret`` as there."""
    bsz, t, channels = qkv_in.shape
    _, v_heads, k_dim, v_dim = state.shape
    kernel = conv_weight.shape[-1]
    if conv_state.shape != (bsz, channels, kernel - 1) or conv_weight.shape != (channels, kernel):
        raise ValueError(f"conv_state {conv_state.shape} / conv_weight {conv_weight.shape} do not fit {channels} "
                         f"channels of a kernel of {kernel}")
    if resolve_impl(impl, k_dim, v_dim) == "jnp":
        qkv, tail = causal_conv_jnp(qkv_in, conv_state, conv_weight, n_valid)
        out, new_state = gated_delta_decode(qkv, g, beta, state, k_heads=k_heads, impl="jnp")
        return out, qkv, tail, new_state
    if channels != 2 * k_heads * k_dim + v_heads * v_dim or v_heads % k_heads:
        raise ValueError(f"qkv has {channels} channels; {k_heads} key heads of {k_dim} and {v_heads} value heads of "
                         f"{v_dim} need {2 * k_heads * k_dim + v_heads * v_dim} (and Hv a multiple of Hk)")
    bv = min(block_v or default_block_v(t), v_dim)
    if not (is_pow2(k_dim) and is_pow2(bv) and v_dim % bv == 0) or kernel < 2:
        raise ValueError(f"the Pallas conv + delta rule needs a power-of-two Dk, a power-of-two block_v dividing Dv "
                         f"and a conv kernel of at least 2, got Dk={k_dim}, Dv={v_dim}, block_v={bv}, "
                         f"kernel={kernel}")
    f32 = jnp.float32
    gb = jnp.stack([g.astype(f32), beta.astype(f32)], axis=-1)
    body = functools.partial(_conv_kernel, tokens=t, v_heads=v_heads, group=v_heads // k_heads, k_dim=k_dim,
                             v_dim=v_dim, block_v=bv, kernel=kernel)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=1)}
    out, qkv, tail, new_state = pl.pallas_call(
        body,
        grid=(bsz * v_heads, v_dim // bv),
        out_shape=(jax.ShapeDtypeStruct((bsz, t, v_heads, v_dim), f32),
                   jax.ShapeDtypeStruct(qkv_in.shape, qkv_in.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct((bsz * v_heads, k_dim, v_dim), f32)),
        input_output_aliases={5: 3},
        interpret=interpret,
        **kwargs,
    )(qkv_in, conv_state, conv_weight, gb, n_valid.astype(jnp.int32), state.astype(f32).reshape(bsz * v_heads, k_dim,
                                                                                                 v_dim))
    return out, qkv, tail, new_state.reshape(state.shape)
