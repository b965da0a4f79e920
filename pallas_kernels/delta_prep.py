"""The per-chunk part of the chunked gated delta rule (Gated DeltaNet prefill) as one Pallas kernel: everything
`strata_jax.model.deltanet.chunk_gated_delta_rule` computes for each chunk of C tokens before the recurrence over
chunks (`pallas_kernels.delta_chunk.chunk_scan`).

Per (batch, value head, chunk), with ``cum`` the running sum of the log-decays ``g`` inside the chunk::

    decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    A           = strictly_lower(beta * K K^T * decay)          # the UT system is I + A
    u           = (I + A)^-1 (beta * V)                          # UT-transformed values
    w           = (I + A)^-1 (beta * exp(cum) * K)               # UT-transformed keys
    intra       = lower(Q K^T * decay), q_dec = Q exp(cum), k_dec = K exp(cum_C - cum)

XLA runs this as ~a dozen batched kernels over [B, H, N, C, C] and [B, H, N, C, D] arrays, each read and written
through HBM, its float32 matmuls on the FMA units (`Precision.HIGHEST`); here one program per (batch, head, chunk)
reads its q, k, v rows once from the model's [B, T, H, D] layout (no transposes) and keeps every intermediate in
registers. The inverse is the doubling of `strata_jax.model.deltanet.unit_lower_inverse` (the blocked form's
sub-matrices are not addressable in registers), its dots on the tensor cores at ``precision`` (default "tf32x3":
three TF32 passes, float32-like; the XLA form is the reference, `tests/kernels/test_delta_prep.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.delta_chunk import KERNEL_PRECISIONS
from pallas_kernels.delta_rule import is_pow2

# Launch settings and dot precision when a call names none (a bench form sets them per run).
NUM_WARPS = 4
PRECISION = "tf32x3"


def _kernel(q_ref, k_ref, v_ref, cum_ref, beta_ref, u_ref, w_ref, qd_ref, kd_ref, a_ref, *, chunk, precision):
    b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(n * chunk, chunk)
    dot = functools.partial(jax.lax.dot, precision=precision, preferred_element_type=jnp.float32)
    q, k, v = q_ref[b, rows, h, :], k_ref[b, rows, h, :], v_ref[b, rows, h, :]  # [C, D] float32
    cum, beta = cum_ref[b, h, n, :], beta_ref[b, h, n, :]  # [C]
    last = cum_ref[b, h, n, chunk - 1]
    i = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    lower = i >= j
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
    kt = k.T
    a = jnp.where(i > j, dot(k * beta[:, None], kt) * decay, 0.0)
    # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is nilpotent, the series ends at A^C.
    inverse = jnp.where(i == j, 1.0, 0.0) - a
    power, covered = dot(a, a), 2
    while covered < chunk:
        inverse = inverse + dot(inverse, power)
        covered *= 2
        if covered < chunk:
            power = dot(power, power)
    grow = jnp.exp(cum)
    u_ref[b, h, n] = dot(inverse, v * beta[:, None])
    w_ref[b, h, n] = dot(inverse, k * (beta * grow)[:, None])
    a_ref[b, h, n] = jnp.where(lower, dot(q, kt) * decay, 0.0)
    qd_ref[b, h, n] = q * grow[:, None]
    kd_ref[b, h, n] = k * jnp.exp(last - cum)[:, None]


def chunk_prep(q, k, v, cum, beta, *, chunk: int, precision: str | None = None, num_warps: int | None = None,
               interpret: bool = False):
    """q, k [B, T, H, Dk], v [B, T, H, Dv] float32 with T a multiple of ``chunk``; cum (the log-decays' running
    sum inside each chunk) and beta [B, H, N, C] float32. Returns (u [B, H, N, C, Dv], w, q_dec, k_dec
    [B, H, N, C, Dk], intra [B, H, N, C, C]): `delta_chunk.chunk_scan`'s inputs. ``precision``
    (`delta_chunk.KERNEL_PRECISIONS`) and ``num_warps`` default to `PRECISION` and `NUM_WARPS`; interpret mode (off a
    GPU) runs its dots in float32."""
    bsz, t, heads, dk = k.shape
    dv = v.shape[-1]
    n = t // chunk
    if t % chunk or q.shape != k.shape or v.shape[:3] != (bsz, t, heads):
        raise ValueError(f"q, k must be [B, T, H, Dk] and v [B, T, H, Dv] with T a multiple of {chunk}, got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if cum.shape != (bsz, heads, n, chunk) or beta.shape != cum.shape:
        raise ValueError(f"cum and beta must be [B, H, N, C] = {(bsz, heads, n, chunk)}, got {cum.shape}, "
                         f"{beta.shape}")
    if not all(is_pow2(d) and d >= 16 for d in (chunk, dk, dv)):
        raise ValueError(f"chunk, Dk and Dv must be powers of two >= 16 (Triton's dots), got {chunk}, {dk}, {dv}")
    precision = precision or PRECISION
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(KERNEL_PRECISIONS)}, got {precision!r}")
    f32 = jnp.float32
    shape = lambda d: jax.ShapeDtypeStruct((bsz, heads, n, chunk, d), f32)  # noqa: E731
    kwargs = {} if interpret else {
        "compiler_params": pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=1)}
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk,
                          precision=jax.lax.Precision.HIGHEST if interpret else KERNEL_PRECISIONS[precision]),
        grid=(bsz, heads, n),
        out_shape=(shape(dv), shape(dk), shape(dk), shape(dk), shape(chunk)),
        interpret=interpret,
        **kwargs,
    )(*(x.astype(f32) for x in (q, k, v, cum, beta)))
