"""A few tokens times a weight matrix, with the ops around it fused in: one Pallas kernel beside its XLA form.

For tokens ``x [T, K]`` and a weight ``w [N, K]`` (torch layout), each part optional::

    x   = RMSNorm(x) * (offset + norm)            prologue: float32, rounded to x.dtype (offset 1: zero-centred)
    y   = x @ w.T                                 in w's dtype (float32 accumulation, rounded)
    y   = silu(y) * (x @ up.T)                    a gated product (the MLP's gate and up projections)
    y   = sigmoid(gate_x @ gate_w.T) * y          a per-token gate computed from other inputs (the shared expert's)
    out = residual + y                            epilogue

The shared expert of a MoE block is two of these: ``silu(x @ gate.T) * (x @ up.T)``, then ``routed +
sigmoid(x @ shared_gate.T) * (act @ down.T)``. XLA runs those as a split-K GEMM and its reduction, the gated product,
another split-K GEMM and its reduction, the gate's matvec and the sigmoid-product-add fusion: six or more kernels
where this is two.

Program j computes output columns ``j*block_n ..`` for every token: each program recomputes the prologue's norm for
its tokens (a sum of squares over K: T x K elements, a few KB) and, for the gate, the gate's dot (Kg elements of
``gate_w``), instead of waiting for another kernel; the weights are read once. ``tl.dot`` needs M >= 16, so the
kernel works on 16 rows with masked loads and stores (at most ``MAX_TOKENS`` tokens). Rounding follows the XLA form
op for op (every op's result rounded to its dtype, a cast being free), except that the dots add in another order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.activations import silu

IMPLS = ("auto", "xla", "pallas")
MAX_TOKENS = 16
ROWS = 16  # tl.dot's smallest M
BLOCK_N = 16  # not yet tuned on a device (docs/PERF.md, "Fused decode kernels")
STEP_K = 256
_NT = (((1,), (1,)), ((), ()))  # x @ w.T with w in torch layout [out, in]


def _linear(x, w):
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


def matvec_xla(x, w, *, up=None, norm=None, eps: float = 1e-6, offset: float = 1.0, gate=None, residual=None):
    """The reference, in the model's jnp forms op for op (`RMSNorm`, `Linear`, `MLP`, the shared expert's gate).
    Same arguments and result as ``fused_matvec``."""
    if norm is not None:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        x = (xf * (offset + norm.astype(jnp.float32))).astype(x.dtype)
    y = _linear(x, w)
    if up is not None:
        y = silu(y) * _linear(x, up)
    if gate is not None:
        y = jax.nn.sigmoid(_linear(gate[0], gate[1])) * y
    if residual is not None:
        y = residual + y
    return y


def resolve_impl(impl: str, tokens: int) -> str:
    """"auto": the kernel on a GPU for at most ``MAX_TOKENS`` tokens, else XLA (for every fused decode kernel)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and tokens <= MAX_TOKENS else "xla"
    return impl


def _round(x, dtype):
    """x rounded to dtype and back to float32: the reference's rounding points."""
    return x.astype(dtype).astype(jnp.float32)


def _kernel(*refs, tokens, k_dim, n, gate_k, block_n, step_k, eps, offset, has_up, has_norm, has_gate,
            has_residual, poison):
    refs = list(refs)
    out_ref = refs.pop()
    if poison:
        refs.pop()
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    up_ref = refs.pop(0) if has_up else None
    norm_ref = refs.pop(0) if has_norm else None
    gx_ref, gw_ref = (refs.pop(0), refs.pop(0)) if has_gate else (None, None)
    res_ref = refs.pop(0) if has_residual else None
    f32, dtype = jnp.float32, w_ref.dtype
    n0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
    row_ok = (jnp.arange(ROWS) < tokens)[:, None]
    n_ok = (n0 + jnp.arange(block_n) < n)[:, None]
    n_steps = -(-k_dim // step_k)

    def x_chunk(k0):
        ok = row_ok & (k0 + jnp.arange(step_k) < k_dim)[None, :]
        return pltriton.load(x_ref.at[pl.ds(0, ROWS), pl.ds(k0, step_k)], mask=ok, other=0.0).astype(f32), ok

    if has_norm:  # every program computes the norm of its tokens itself: T x K elements, cheaper than a launch
        def sumsq(i, acc):
            x, _ = x_chunk(pl.multiple_of(i * step_k, step_k))
            return acc + jnp.sum(x * x, axis=1)

        scale = jax.lax.rsqrt(jax.lax.fori_loop(0, n_steps, sumsq, jnp.zeros((ROWS,), f32)) / k_dim + eps)

    def step(i, accs):
        k0 = pl.multiple_of(i * step_k, step_k)
        x, _ = x_chunk(k0)
        col_ok = k0 + jnp.arange(step_k) < k_dim
        w_ok = n_ok & col_ok[None, :]
        if has_norm:
            g = pltriton.load(norm_ref.at[pl.ds(k0, step_k)], mask=col_ok, other=0.0).astype(f32)
            x = _round(x * scale[:, None] * (offset + g)[None, :], x_ref.dtype)
        x = x.astype(dtype)
        w = pltriton.load(w_ref.at[pl.ds(n0, block_n), pl.ds(k0, step_k)], mask=w_ok, other=0.0)
        dot = functools.partial(jax.lax.dot_general, dimension_numbers=_NT, precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=f32)
        accs = (accs[0] + dot(x, w),) + accs[1:]
        if has_up:
            u = pltriton.load(up_ref.at[pl.ds(n0, block_n), pl.ds(k0, step_k)], mask=w_ok, other=0.0)
            accs = (accs[0], accs[1] + dot(x, u))
        return accs

    zero = jnp.zeros((ROWS, block_n), f32)
    accs = jax.lax.fori_loop(0, n_steps, step, (zero, zero) if has_up else (zero,))
    y = _round(accs[0], dtype)
    if has_up:
        act = _round(y / _round(1.0 + _round(jnp.exp(-y), dtype), dtype), dtype)  # silu, rounded as jnp rounds it
        y = _round(act * _round(accs[1], dtype), dtype)
    if has_gate:
        gdt = gw_ref.dtype

        def gate_step(i, acc):
            k0 = pl.multiple_of(i * step_k, step_k)
            ok = (k0 + jnp.arange(step_k) < gate_k)[None, :]
            gx = pltriton.load(gx_ref.at[pl.ds(0, ROWS), pl.ds(k0, step_k)], mask=row_ok & ok, other=0.0)
            # The gate's one row, padded to a dot's 16 by masked loads.
            gw = pltriton.load(gw_ref.at[pl.ds(0, ROWS), pl.ds(k0, step_k)],
                               mask=(jnp.arange(ROWS) < 1)[:, None] & ok, other=0.0)
            return acc + jax.lax.dot_general(gx.astype(gdt), gw, _NT, precision=jax.lax.Precision.HIGHEST,
                                             preferred_element_type=f32)

        logit = jax.lax.fori_loop(0, -(-gate_k // step_k), gate_step, jnp.zeros((ROWS, ROWS), f32))
        logit = _round(jnp.sum(jnp.where(jnp.arange(ROWS)[None, :] == 0, logit, 0.0), axis=1), gdt)
        y = _round(_round(jax.nn.sigmoid(logit), gdt)[:, None] * y, jnp.result_type(gdt, dtype))
    ok = row_ok & (n0 + jnp.arange(block_n) < n)[None, :]
    if has_residual:
        r = pltriton.load(res_ref.at[pl.ds(0, ROWS), pl.ds(n0, block_n)], mask=ok, other=0.0).astype(f32)
        y = r + y
    pltriton.store(out_ref.at[pl.ds(0, ROWS), pl.ds(n0, block_n)], y.astype(out_ref.dtype), mask=ok)


def _out_dtype(w, up, gate, residual):
    dtype = w.dtype
    if gate is not None:
        dtype = jnp.result_type(gate[1].dtype, dtype)
    return dtype if residual is None else jnp.result_type(residual.dtype, dtype)


def _check(x, w, up, norm, gate, residual):
    t, k = x.shape
    bad = []
    if w.ndim != 2 or w.shape[1] != k:
        bad.append(f"w is {w.shape}, expected [N, {k}]")
    n = w.shape[0]
    if up is not None and up.shape != w.shape:
        bad.append(f"up is {up.shape}, expected {w.shape}")
    if norm is not None and norm.shape != (k,):
        bad.append(f"norm is {norm.shape}, expected ({k},)")
    if gate is not None and (gate[0].shape[0] != t or gate[1].shape != (1, gate[0].shape[1])):
        bad.append(f"gate is {gate[0].shape} x {gate[1].shape}, expected [{t}, Kg] x [1, Kg]")
    if residual is not None and residual.shape != (t, n):
        bad.append(f"residual is {residual.shape}, expected ({t}, {n})")
    if bad:
        raise ValueError("fused_matvec shapes: " + ", ".join(bad))


def fused_matvec(x, w, *, up=None, norm=None, eps: float = 1e-6, offset: float = 1.0, gate=None, residual=None,
                 impl: str = "auto", block_n: int = BLOCK_N, step_k: int = STEP_K, num_warps: int = 4,
                 interpret: bool = False, poison: bool = False):
    """x [.., K] @ w.T (w [N, K]) with the optional prologue and epilogue of the module docstring -> [.., N].

    ``up`` [N, K]: the gated product ``silu(x @ w.T) * (x @ up.T)``. ``norm`` [K]: RMSNorm of x first (weight
    ``offset + norm``, ``eps``). ``gate = (gate_x [.., Kg], gate_w [1, Kg])``: times ``sigmoid(gate_x @
    gate_w.T)`` per token. ``residual`` [.., N]: added last. The result has w's dtype (promoted with the gate's
    and the residual's). Equals ``matvec_xla``, which is what ``impl="xla"`` runs.

    ``impl``: "xla", "pallas" or "auto" (``resolve_impl``, on the flattened token count). ``block_n`` (output
    columns per program) and ``step_k`` (the contraction walked in steps of this many columns) are powers of two of
    at least 16; ``num_warps`` tunes the kernel. ``interpret`` runs it in Pallas interpret mode (CPU tests);
    ``poison`` (testing aid) starts the output as NaN so that unwritten elements show."""
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k)
    tokens = x.shape[0]
    if gate is not None:
        gate = (gate[0].reshape(tokens, -1), gate[1])
    if residual is not None:
        residual = residual.reshape(tokens, -1)
    _check(x, w, up, norm, gate, residual)
    n = w.shape[0]
    if resolve_impl(impl, tokens) == "xla":
        out = matvec_xla(x, w, up=up, norm=norm, eps=eps, offset=offset, gate=gate, residual=residual)
        return out.reshape(*lead, n)
    if tokens > MAX_TOKENS:
        raise ValueError(f"the Pallas matvec takes at most {MAX_TOKENS} tokens, got {tokens}")
    if any(b & (b - 1) or b < 16 for b in (block_n, step_k)):
        raise ValueError(f"block_n and step_k must be powers of two >= 16, got {block_n}, {step_k}")
    args = [x, w] + [a for a in (up, norm) if a is not None]
    if gate is not None:
        args += list(gate)
    if residual is not None:
        args.append(residual)
    out_shape = jax.ShapeDtypeStruct((tokens, n), _out_dtype(w, up, gate, residual))
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=2)}
    if poison:
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        kwargs["input_output_aliases"] = {len(args) - 1: 0}
    kernel = functools.partial(_kernel, tokens=tokens, k_dim=k, n=n, gate_k=0 if gate is None else gate[0].shape[1],
                               block_n=block_n, step_k=step_k, eps=eps, offset=offset, has_up=up is not None,
                               has_norm=norm is not None, has_gate=gate is not None,
                               has_residual=residual is not None, poison=poison)
    out = pl.pallas_call(kernel, grid=(-(-n // block_n),), out_shape=out_shape, interpret=interpret, **kwargs)(*args)
    return out.reshape(*lead, n)
