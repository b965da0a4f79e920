"""The inter-chunk recurrence of the chunked gated delta rule (Gated DeltaNet prefill) as one Pallas kernel beside
its jnp form.

`strata_jax.model.deltanet.chunk_gated_delta_rule` prepares, for every chunk n of C tokens and every (batch, value
head), the UT-transformed values ``u`` and keys ``w`` and the decayed ``q``, ``k`` and intra-chunk attention; what
is left is sequential over the chunks, with the state ``S [Dk, Dv]``::

    v_new = u_n - w_n @ S
    out_n = q_n @ S + A_n @ v_new
    S     = S * d_n + k_n^T @ v_new

As an XLA scan that is ~8 small kernels per chunk (four dots, their elementwise parts, the slices of the stacked
inputs and the carry copies): 64 chunks x 36 layers per 4,096-token prompt chunk at Flash-Next shapes, ~15% of a
20,000-token prefill's device time on an H100 and most of its ~170,000 kernel launches (docs/PERF.md, "Prefill at
agent-sized prompts"). Here one program owns a ``[Dk, block_v]`` column block of one head's state and walks every
chunk with it in registers: one kernel per layer and prompt chunk, the GPU's default ("auto"): 1.49x the XLA loop
per layer on an H100 (2026-12-07).

A second form, ``impl="assoc"``, has no loop over chunks at all: the update is affine in S,
``S' = M_n S + B_n`` with ``M_n = d_n I - k_n^T w_n`` and ``B_n = k_n^T u_n``, so every chunk's starting state is
a prefix composition, computed by `jax.lax.associative_scan` in log2(N) levels of batched ``[Dk, Dk]`` matmuls;
the outputs then follow for all chunks at once. More flops (two ``Dk x Dk`` products per combine) for far fewer
kernels; measured slower than the loop on an H100 (0.87x per layer at one prompt, 0.77x at four), so "auto" does not
take it.

A third, ``impl="states"``, keeps the loop but only the state's own path in it: each step computes ``v_new`` and
the next ``S`` (two dots) and keeps the state each chunk starts from; every chunk's output, ``q_n @ S_n + A_n @
v_new``, is then two batched products over all chunks at once. Half the dots in the sequential part, at the price
of the per-chunk states in memory (``[N, Dk, Dv]`` float32 per head: 200 MB per layer for a 4,096-token chunk at
Flash-Next shapes).

Precision: the kernel's dots run as three TF32 tensor-core passes by default (`KERNEL_PRECISION`), close to float32;
exact float32 dots (``Precision.HIGHEST``, Triton's "ieee") run on the FMA units, which made the kernel 3.2x slower
than the XLA scan until 2026-12-07.

Reverse-mode differentiation (the demo trainer differentiates the model) goes through the jnp form: the kernel has
no transpose, so its backward pass recomputes the scan's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.delta_rule import is_pow2

IMPLS = ("auto", "jnp", "assoc", "states", "pallas")
# Whether "auto" takes the kernel on a GPU: on since its dots run on the tensor cores (`KERNEL_PRECISION`): 1.49x the
# XLA loop per layer at one prompt, 1.33x at four, a 20,000-token prefill 2.035 -> 1.856 s (H100, 2026-12-07;
# docs/PERF.md, "Prefill at agent-sized prompts"). With float32 FMA dots it was 3.2x slower than the loop.
AUTO_PALLAS = True
# What "auto" takes on a GPU when the kernel is off: the loop ("jnp") or the parallel prefix ("assoc"). The loop:
# the prefix measured 0.87x its speed per layer at 1 prompt, 0.77x at 4 (H100, docs/PERF.md "Prefill at agent-sized
# prompts"); its extra [Dk, Dk] products cost more than the loop's launches save.
AUTO_GPU_FORM = "jnp"
# The kernel's launch and dot settings when a call names none (a bench form sets them per run; docs/PERF.md).
BLOCK_V = 32
NUM_WARPS = 4
NUM_STAGES = 1
# How the kernel's float32 dots run on a GPU (`KERNEL_PRECISIONS`): "ieee" is exact float32 on the FMA units, no
# tensor cores (15x slower than "tf32x3" on an H100); "tf32x3" three TF32 tensor-core passes (float32-like: the rule
# 1.1e-4 from the float32 loop, XLA's forms 4.8e-4); "tf32" one pass, 1.24x faster again but coarse on large states
# (tests/kernels/test_delta_chunk.py). Interpret mode always runs float32.
KERNEL_PRECISION = "tf32x3"
KERNEL_PRECISIONS = {
    "ieee": jax.lax.Precision.HIGHEST,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
}
_HI = jax.lax.Precision.HIGHEST


def chunk_scan_jnp(u, w, q, k, a, decay, state):
    """The recurrence as an XLA scan. u [B, H, N, C, Dv], w, q, k [B, H, N, C, Dk], a [B, H, N, C, C], decay
    [B, H, N], state [B, H, Dk, Dv]; float32. Returns (out [B, H, N, C, Dv], final state)."""

    def step(s, xs):
        u_n, w_n, q_n, k_n, a_n, d_n = xs
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s)
        out = jnp.einsum("bhck,bhkv->bhcv", q_n, s) + jnp.einsum("bhcj,bhjv->bhcv", a_n, v_new)
        s = s * d_n[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_n, v_new)
        return s, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q, k, a, decay))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 2), state


def chunk_scan_states(u, w, q, k, a, decay, state):
    """`chunk_scan_jnp` (same arguments and results) with only the state's path in the loop; the outputs after it."""

    def step(s, xs):
        u_n, w_n, k_n, d_n = xs
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s)
        return s * d_n[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_n, v_new), (s, v_new)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, k, decay))
    state, (before, v_new) = jax.lax.scan(step, state, xs)
    before, v_new = jnp.moveaxis(before, 0, 2), jnp.moveaxis(v_new, 0, 2)
    out = jnp.einsum("bhnck,bhnkv->bhncv", q, before) + jnp.einsum("bhncj,bhnjv->bhncv", a, v_new)
    return out, state


def chunk_scan_assoc(u, w, q, k, a, decay, state):
    """`chunk_scan_jnp` (same arguments and results) as a parallel prefix over the chunks, no sequential loop."""
    dk = w.shape[-1]
    m = decay[..., None, None] * jnp.eye(dk, dtype=w.dtype) - jnp.einsum("bhnck,bhncj->bhnkj", k, w)
    b = jnp.einsum("bhnck,bhncv->bhnkv", k, u)
    # The initial state folds into the first chunk's offset, so each prefix's offset is the state after it.
    b = b.at[:, :, 0].add(jnp.einsum("bhkj,bhjv->bhkv", m[:, :, 0], state))

    def compose(earlier, later):
        m1, b1 = earlier
        m2, b2 = later
        return jnp.einsum("...kj,...ji->...ki", m2, m1), jnp.einsum("...kj,...jv->...kv", m2, b1) + b2

    _, after = jax.lax.associative_scan(compose, (m, b), axis=2)
    before = jnp.concatenate([state[:, :, None], after[:, :, :-1]], axis=2)
    v_new = u - jnp.einsum("bhnck,bhnkv->bhncv", w, before)
    out = jnp.einsum("bhnck,bhnkv->bhncv", q, before) + jnp.einsum("bhncj,bhnjv->bhncv", a, v_new)
    return out, after[:, :, -1]


def resolve_impl(impl: str, chunk: int, dk: int, dv: int) -> str:
    """"auto": the kernel on a GPU (while `AUTO_PALLAS`) when C, Dk and Dv are powers of two of at least 16 (Triton's
    block and dot constraints); else `AUTO_GPU_FORM` on a GPU and the jnp form elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        fits = all(is_pow2(n) and n >= 16 for n in (chunk, dk, dv))
        if jax.default_backend() != "gpu":
            return "jnp"
        return "pallas" if AUTO_PALLAS and fits else AUTO_GPU_FORM
    return impl


def _kernel(u_ref, w_ref, q_ref, k_ref, a_ref, d_ref, s_ref, o_ref, s_out_ref, *, n_chunks, block_v, precision):
    row = pl.program_id(0)
    cols = pl.ds(pl.program_id(1) * block_v, block_v)
    dot = functools.partial(jax.lax.dot, precision=precision, preferred_element_type=jnp.float32)

    def chunk(n, s):  # s [Dk, block_v] float32, the state block before chunk n
        v_new = u_ref[row, n, :, cols] - dot(w_ref[row, n], s)  # [C, block_v]
        o_ref[row, n, :, cols] = dot(q_ref[row, n], s) + dot(a_ref[row, n], v_new)
        return s * d_ref[row, n] + dot(k_ref[row, n].T, v_new)

    s_out_ref[row, :, cols] = jax.lax.fori_loop(0, n_chunks, chunk, s_ref[row, :, cols])


def chunk_scan(u, w, q, k, a, decay, state, *, impl: str = "auto", block_v: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None, precision: str | None = None,
               interpret: bool = False):
    """`chunk_scan_jnp` (same arguments and results) as one kernel per call, or the jnp, assoc or states form by
    ``impl`` (`resolve_impl`). The kernel's ``block_v`` (state columns per program, at most Dv), ``num_warps``,
    ``num_stages`` (Triton's software pipelining of the loop over chunks) and ``precision`` (`KERNEL_PRECISIONS`)
    default to `BLOCK_V`, `NUM_WARPS`, `NUM_STAGES` and `KERNEL_PRECISION`; the state is updated in place (the new
    one aliases the old one's buffer)."""
    bsz, heads, n_chunks, c, dv = u.shape
    dk = w.shape[-1]
    if w.shape != (bsz, heads, n_chunks, c, dk) or q.shape != w.shape or k.shape != w.shape:
        raise ValueError(f"w, q, k must be [B, H, N, C, Dk] = {(bsz, heads, n_chunks, c, dk)}, got {w.shape}, "
                         f"{q.shape}, {k.shape}")
    if a.shape != (bsz, heads, n_chunks, c, c) or decay.shape != (bsz, heads, n_chunks):
        raise ValueError(f"a must be [B, H, N, C, C] and decay [B, H, N], got {a.shape} and {decay.shape}")
    if state.shape != (bsz, heads, dk, dv):
        raise ValueError(f"state must be [B, H, Dk, Dv] = {(bsz, heads, dk, dv)}, got {state.shape}")
    resolved = resolve_impl(impl, c, dk, dv)
    if resolved == "jnp":
        return chunk_scan_jnp(u, w, q, k, a, decay, state)
    if resolved == "assoc":
        return chunk_scan_assoc(u, w, q, k, a, decay, state)
    if resolved == "states":
        return chunk_scan_states(u, w, q, k, a, decay, state)
    bv = min(block_v or BLOCK_V, dv)
    if not (is_pow2(bv) and bv >= 16 and dv % bv == 0):
        raise ValueError(f"block_v must be a power of two >= 16 dividing Dv = {dv}, got {bv}")
    precision = precision or KERNEL_PRECISION
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(KERNEL_PRECISIONS)}, got {precision!r}")
    launch = (bv, num_warps or NUM_WARPS, num_stages or NUM_STAGES, precision)
    return _scan_kernel(u, w, q, k, a, decay, state, launch, interpret)


def _run_kernel(u, w, q, k, a, decay, state, launch, interpret):
    bsz, heads, n_chunks, c, dv = u.shape
    dk = w.shape[-1]
    block_v, num_warps, num_stages, precision = launch
    f32 = jnp.float32
    rows = bsz * heads
    flat = lambda x: x.astype(f32).reshape(rows, *x.shape[2:])  # noqa: E731
    kwargs = {} if interpret else {
        "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    # Off a GPU (interpret mode) the dots run in float32 whatever the setting: XLA:CPU has no TF32 algorithms.
    dot_precision = _HI if interpret else KERNEL_PRECISIONS[precision]
    out, new_state = pl.pallas_call(
        functools.partial(_kernel, n_chunks=n_chunks, block_v=block_v, precision=dot_precision),
        grid=(rows, dv // block_v),
        out_shape=(jax.ShapeDtypeStruct((rows, n_chunks, c, dv), f32), jax.ShapeDtypeStruct((rows, dk, dv), f32)),
        input_output_aliases={6: 1},
        interpret=interpret,
        **kwargs,
    )(flat(u), flat(w), flat(q), flat(k), flat(a), flat(decay), flat(state))
    return out.reshape(u.shape), new_state.reshape(state.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _scan_kernel(u, w, q, k, a, decay, state, launch, interpret):
    return _run_kernel(u, w, q, k, a, decay, state, launch, interpret)


def _scan_kernel_fwd(u, w, q, k, a, decay, state, launch, interpret):
    return _run_kernel(u, w, q, k, a, decay, state, launch, interpret), (u, w, q, k, a, decay, state)


def _scan_kernel_bwd(launch, interpret, inputs, grads):
    _, vjp = jax.vjp(chunk_scan_jnp, *inputs)
    return vjp(grads)


_scan_kernel.defvjp(_scan_kernel_fwd, _scan_kernel_bwd)
