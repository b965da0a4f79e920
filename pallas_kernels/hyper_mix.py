"""One hyper-connection call (the block-input mix, its inject weights, and a pending injection) as three Pallas
kernels beside its jnp form.

For streams ``x [T, hc*H]`` (stream s in columns ``s*H .. s*H+H-1``), norm weight ``gamma [hc*H]`` and the
projections ``w_down [R, hc*H]``, ``w_up [hc*H, R]``, ``w_inject [hc, hc*H]`` (torch layout)::

    normed   = RMSNorm_s(x) * (1 + gamma)                  (per stream group of H, rounded to x.dtype)
    mix      = sigmoid(silu(normed @ w_down.T / hc) @ w_up.T)
    mixed    = mean_s(mix * normed)                        [T, H]
    inject_w = 2 * sigmoid(normed @ w_inject.T / hc)       [T, hc]

At decode the jnp form is 8-10 small XLA kernels per call. Here one call is three ``pallas_call``s and no XLA op
(the injection that precedes the call in the model, ``x + block_out * w``, is folded into the first). On an H200
they are still slower than XLA's fusions (docs/PERF.md, "Fused hyper-connection kernels"), so "auto" keeps the jnp
form:

* The norm is per stream group and a group is a contiguous range of the contraction axis, so a projection of
  ``normed`` splits into per-group projections of the un-normalised input, scaled afterwards:
  ``normed @ W.T = sum_s rsqrt(mean_s(x^2) + eps) * (x_s * (1 + gamma_s)) @ W_s.T``. Kernel A (``_project_kernel``,
  grid ``(hc, H/block_k, R/block_r + 1)``) computes those products without waiting for the norm: program
  ``(s, kc, j)`` contracts columns block kc of group s with down-projection rows ``j*block_r ..`` or, for the last
  j, with the hc inject rows (padded to a dot's width by masked loads), and adds up the block's sums of squares and
  writes the injected streams. Its output is one partial per block: 220 programs at the real shape (hc 4, H 2560,
  R 320, block_k 512, block_r 32), each walking its block in steps whose float32 tiles stay in registers.
* Kernel B (``_reduce_kernel``, grid ``(R/block_r,)``) adds kernel A's partials in a fixed order (no atomics,
  bit-reproducible results), finishes the norm from the sums of squares and writes ``silu(down / hc)``, the
  per-stream norm scales and the inject weights.
* Kernel C (``_mix_kernel``, grid ``(H/block_h,)``) runs the up projection for its columns of all hc streams (one
  dot per R chunk, the streams being a block axis), its sigmoid, times the recomputed ``normed``, and the mean.

Tokens: Triton blocks are powers of two and ``tl.dot`` needs M >= 16, so the kernels work on ``Tp =
max(16, next_pow2(T))`` rows with masked loads and stores (no padded copies of the inputs, which would each be
another launch). Rounding: the reference rounds to the model dtype after every op; the kernels do the same (a cast
is free) except inside the down / inject projections, which see ``x * (1 + gamma)`` (the norm comes after)
instead of the rounded ``normed``. The projections are dots with operands in the weight dtype and float32
accumulation (float32 weights: IEEE, not TF32).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.activations import silu

IMPLS = ("auto", "jnp", "pallas")
MAX_TOKENS = 64  # the kernels keep [Tp, block] tiles of every stream in registers
# Three versions measured slower than XLA's fusions on an H200 (docs/PERF.md, "Fused hyper-connection kernels",
# 2026-11-30: this one 37-55 us per call against 23-33). Until the kernels beat XLA in `bench --mode hyper` and in
# the step, "auto" keeps the jnp form; impl="pallas" runs the kernels.
AUTO_PALLAS = False
BLOCK_K = 512
BLOCK_R = 32
BLOCK_H = 16
CHUNK_R = 64
MAX_TILE = 4096
_NT = (((1,), (1,)), ((), ()))  # x @ w.T with w in torch layout [out, in]


def inject(streams: jax.Array, block_out: jax.Array, weights: jax.Array) -> jax.Array:
    """streams [.., hc*H] + block_out [.., H] broadcast to every stream, scaled per stream by weights [.., hc]."""
    added = block_out[..., None, :] * weights[..., :, None]
    return streams + added.reshape(streams.shape)


def _linear(x, w):
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


def hyper_mix_jnp(streams, gamma, w_down, w_up, w_inject, *, hc: int, eps: float, pending=None):
    """The reference: the model's jnp hyper-connection, op for op. Same arguments and results as ``hyper_mix``."""
    if pending is not None:
        streams = inject(streams, *pending)
    hidden = streams.shape[-1] // hc
    xf = streams.astype(jnp.float32).reshape(*streams.shape[:-1], hc, hidden)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    normed = (normed.reshape(streams.shape) * (1.0 + gamma.astype(jnp.float32))).astype(streams.dtype)
    mix = silu(_linear(normed, w_down) / hc)
    mix = jax.nn.sigmoid(_linear(mix, w_up))
    split = lambda y: y.reshape(*y.shape[:-1], hc, hidden)  # noqa: E731
    mixed = jnp.mean(split(mix) * split(normed), axis=-2)
    weights = None if w_inject is None else 2 * jax.nn.sigmoid(_linear(normed, w_inject) / hc)
    return mixed, weights, streams


def _pow2_block(n: int, cap: int) -> int | None:
    """The largest power of two <= cap dividing n, if it is at least 16 (Triton's smallest dot side)."""
    b = 1 << (min(n, cap).bit_length() - 1) if n > 0 else 0
    while b >= 16 and n % b:
        b //= 2
    return b if b >= 16 else None


def _blocks(hc: int, hidden: int, rank: int, block_k: int = BLOCK_K):
    """(block_k, block_r, block_h, chunk_r) for these shapes, or None when the kernels cannot tile them (hc must be a
    power of two, the streams being one block axis of kernel C, and fit with the sum of squares in block_r lanes)."""
    blocks = (_pow2_block(hidden, block_k), _pow2_block(rank, BLOCK_R), _pow2_block(hidden, BLOCK_H),
              _pow2_block(rank, CHUNK_R))
    if None in blocks or hc & (hc - 1) or hc + 1 > blocks[1]:
        return None
    return blocks


def resolve_impl(impl: str, tokens: int, hidden: int, rank: int, hc: int) -> str:
    """"auto": the jnp form while ``AUTO_PALLAS`` is off (the kernels measured slower than XLA). With it on, the Pallas
    kernels on a GPU for at most ``MAX_TOKENS`` tokens when H and R have power-of-two blocks of at least 16
    and hc is a power of two (Triton's block and dot constraints)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        ok = (AUTO_PALLAS and jax.default_backend() == "gpu" and tokens <= MAX_TOKENS
              and _blocks(hc, hidden, rank) is not None)
        return "pallas" if ok else "jnp"
    return impl


def _round(x, dtype):
    """x rounded to dtype and back to float32: the reference's rounding points."""
    return x.astype(dtype).astype(jnp.float32)


def _project_kernel(*refs, tokens, rows, hc, hidden, block_k, step_k, block_r, n_r, dtype, has_inject, has_pending):
    refs = list(refs)
    x_ref, g_ref, wd_ref = refs[:3]
    del refs[:3]
    wi_ref = refs.pop(0) if has_inject else None
    b_ref, pw_ref = (refs.pop(0), refs.pop(0)) if has_pending else (None, None)
    down_ref, extra_ref = refs.pop(0), refs.pop(0)
    ns_ref = refs.pop(0) if has_pending else None
    f32 = jnp.float32
    s, kc, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row_ok = jnp.arange(rows)[:, None] < tokens
    # Every program does [rows, block_k] x [block_k, block_r]: program j < n_r with down-projection rows j*block_r..,
    # the last with the hc inject rows padded to block_r (masked loads read no padding from memory). One code path
    # with few live tiles (the second version's per-stream inject reductions spilled registers), walked in
    # [rows, step_k] steps that keep the tiles in registers, pipelined by Triton (num_stages).
    r0 = pl.multiple_of(jnp.minimum(j, n_r - 1) * block_r, block_r)
    if has_pending:
        pw = pltriton.load(pw_ref.at[pl.ds(0, rows), s], mask=row_ok[:, 0], other=0.0).astype(f32)[:, None]

    def step(i, carry):
        prod, sumsq = carry
        k = pl.multiple_of(kc * block_k + i * step_k, step_k)
        col = pl.multiple_of(s * hidden + k, step_k)
        x = pltriton.load(x_ref.at[pl.ds(0, rows), pl.ds(col, step_k)], mask=row_ok, other=0.0).astype(f32)
        if has_pending:
            b = pltriton.load(b_ref.at[pl.ds(0, rows), pl.ds(k, step_k)], mask=row_ok, other=0.0).astype(f32)
            x = _round(x + _round(b * pw, dtype), dtype)
            pltriton.store(ns_ref.at[pl.ds(0, rows), pl.ds(col, step_k)], x.astype(ns_ref.dtype),
                           mask=row_ok & (j == n_r))
        xs = x * (1.0 + g_ref[pl.ds(col, step_k)].astype(f32))[None, :]
        w = wd_ref[pl.ds(r0, block_r), pl.ds(col, step_k)]
        if has_inject:
            inj_rows = (jnp.arange(block_r) < hc)[:, None]
            w_inj = pltriton.load(wi_ref.at[pl.ds(0, block_r), pl.ds(col, step_k)], mask=inj_rows, other=0.0)
            w = jnp.where(j < n_r, w, w_inj.astype(w.dtype))
        prod = prod + jax.lax.dot_general(xs.astype(w.dtype), w, _NT, precision=jax.lax.Precision.HIGHEST,
                                          preferred_element_type=f32)
        return prod, sumsq + jnp.sum(x * x, axis=1)

    prod, sumsq = jax.lax.fori_loop(0, block_k // step_k, step,
                                    (jnp.zeros((rows, block_r), f32), jnp.zeros((rows,), f32)))

    @pl.when(j < n_r)
    def _down():
        down_ref[s, kc, :, pl.ds(r0, block_r)] = prod

    @pl.when(j == n_r)
    def _extras():
        extra_ref[s, kc] = jnp.where(jnp.arange(block_r)[None, :] == hc, sumsq[:, None], prod)


def _reduce_kernel(down_ref, extra_ref, act_ref, rs_ref, *inj_ref, tokens, rows, hc, hidden, n_k, block_r, eps, dtype):
    """Program j: rows ``j*block_r ..`` of R. Adds kernel A's per-block partials in a fixed order (no atomics,
    bit-reproducible), finishes the norm from the sums of squares, and writes ``silu(down / hc)`` and (program 0)
    the per-stream norm scales and the inject weights."""
    j = pl.program_id(0)
    r0 = pl.multiple_of(j * block_r, block_r)
    rs = [jax.lax.rsqrt(sum(extra_ref[s, q, :, hc] for q in range(n_k)) / hidden + eps) for s in range(hc)]
    down = sum(sum(down_ref[s, q, :, pl.ds(r0, block_r)] for q in range(n_k)) * rs[s][:, None] for s in range(hc))
    v = _round(_round(down, dtype) / hc, dtype)
    act_ref[:, pl.ds(r0, block_r)] = (v * _round(jax.nn.sigmoid(v), dtype)).astype(act_ref.dtype)

    @pl.when(j == 0)
    def _scales_and_inject():
        rs_ref[...] = sum(jnp.where(jnp.arange(hc)[None, :] == s, rs[s][:, None], 0.0) for s in range(hc))
        if inj_ref:
            lane = jnp.arange(block_r)[None, :]
            logits = _round(sum(sum(extra_ref[s, q] for q in range(n_k)) * rs[s][:, None] for s in range(hc)), dtype)
            w = 2.0 * _round(jax.nn.sigmoid(_round(logits / hc, dtype)), dtype)
            ok = (jnp.arange(rows)[:, None] < tokens) & (lane < hc)
            pltriton.store(inj_ref[0].at[pl.ds(0, rows), pl.ds(0, block_r)], w.astype(inj_ref[0].dtype), mask=ok)


def _mix_kernel(x_ref, g_ref, wu_ref, act_ref, rs_ref, mixed_ref, *, tokens, rows, hc, rank, block_h, chunk_r,
                dtype):
    """Program c: columns ``c*block_h ..`` of the block input. The up projection of ``silu(down / hc)`` for those
    columns of every stream (x_ref [T, hc, H], g_ref [hc, H] and wu_ref [hc, H, R] are viewed per stream, so that
    each R chunk is one [rows, chunk_r] x [chunk_r, hc*block_h] dot), its sigmoid, times the recomputed ``normed``,
    averaged over the streams."""
    f32 = jnp.float32
    c0 = pl.multiple_of(pl.program_id(0) * block_h, block_h)
    up = jnp.zeros((rows, hc * block_h), f32)
    for q in range(rank // chunk_r):  # written out: all weight loads of the program can be in flight together
        w = wu_ref[:, pl.ds(c0, block_h), pl.ds(q * chunk_r, chunk_r)].reshape(hc * block_h, chunk_r)
        up = up + jax.lax.dot_general(act_ref[:, pl.ds(q * chunk_r, chunk_r)], w, _NT,
                                      precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
    row_ok = (jnp.arange(rows) < tokens)[:, None, None]
    x = pltriton.load(x_ref.at[pl.ds(0, rows), :, pl.ds(c0, block_h)], mask=row_ok, other=0.0).astype(f32)
    scale = rs_ref[...][:, :, None] * (1.0 + g_ref[:, pl.ds(c0, block_h)].astype(f32))[None]
    normed = _round(x * scale, dtype)
    gate = _round(jax.nn.sigmoid(_round(up.reshape(rows, hc, block_h), dtype)), dtype)
    mixed = jnp.sum(_round(gate * normed, dtype), axis=1) / hc
    pltriton.store(mixed_ref.at[pl.ds(0, rows), pl.ds(c0, block_h)], mixed.astype(mixed_ref.dtype),
                   mask=row_ok[:, :, 0])


def _check_shapes(streams, gamma, w_down, w_up, w_inject, hc, pending):
    width = streams.shape[-1]
    if hc < 1 or width % hc:
        raise ValueError(f"streams have {width} channels, not a multiple of hc={hc}")
    rank = w_down.shape[0]
    want = {"gamma": (width,), "w_down": (rank, width), "w_up": (width, rank)}
    got = {"gamma": gamma.shape, "w_down": w_down.shape, "w_up": w_up.shape}
    if w_inject is not None:
        want["w_inject"], got["w_inject"] = (hc, width), w_inject.shape
    if pending is not None:
        lead = streams.shape[:-1]
        want["block_out"], want["weights"] = (*lead, width // hc), (*lead, hc)
        got["block_out"], got["weights"] = pending[0].shape, pending[1].shape
    bad = {k: (got[k], want[k]) for k in want if tuple(got[k]) != tuple(want[k])}
    if bad:
        raise ValueError("hyper_mix shapes: " + ", ".join(f"{k} is {g}, expected {w}" for k, (g, w) in bad.items()))


def hyper_mix(streams, gamma, w_down, w_up, w_inject, *, hc: int, eps: float, pending=None, impl: str = "auto",
              block_k: int | None = None, num_warps: int = 4, interpret: bool = False):
    """One hyper-connection: streams [.., hc*H] -> (mixed [.., H], inject weights [.., hc] or None, new streams).

    ``gamma [hc*H]`` is the grouped RMSNorm weight, ``w_down [R, hc*H]``, ``w_up [hc*H, R]`` and ``w_inject [hc,
    hc*H]`` (None: no inject weights) the projections in torch layout. ``pending=(block_out [.., H], weights [..,
    hc])`` is an injection (``inject``) applied to the streams first; the new streams are returned (the input
    streams when there is none). Equals ``hyper_mix_jnp``, which is what ``impl="jnp"`` runs.

    ``impl``: "jnp", "pallas" or "auto" (``resolve_impl``, on the flattened token count). ``block_k`` (the columns of
    one group that one program of kernel A contracts, at most this power of two; default ``BLOCK_K``; it walks them
    in steps whose [T, step] float32 tiles stay within ``MAX_TILE`` elements) and ``num_warps`` tune the kernels.
    ``interpret`` runs the kernels in Pallas interpret mode (CPU tests)."""
    _check_shapes(streams, gamma, w_down, w_up, w_inject, hc, pending)
    lead, width = streams.shape[:-1], streams.shape[-1]
    hidden, rank, tokens = width // hc, w_down.shape[0], math.prod(lead)
    # The kernels round the injection to the streams dtype; the jnp form promotes mixed dtypes instead.
    same_dtype = pending is None or all(a.dtype == streams.dtype for a in pending)
    if impl == "auto" and not same_dtype or resolve_impl(impl, tokens, hidden, rank, hc) == "jnp":
        return hyper_mix_jnp(streams, gamma, w_down, w_up, w_inject, hc=hc, eps=eps, pending=pending)
    rows = max(16, pl.next_power_of_2(tokens))
    blocks = _blocks(hc, hidden, rank, block_k or BLOCK_K)
    if blocks is None or tokens > MAX_TOKENS:
        raise ValueError(f"the Pallas hyper_mix needs H and R with power-of-two blocks of at least 16 dividing them, "
                         f"a power-of-two hc, and at most {MAX_TOKENS} tokens, got H={hidden}, R={rank}, hc={hc}, "
                         f"T={tokens}")
    if not same_dtype:
        raise ValueError(f"the Pallas hyper_mix needs the pending injection in the streams dtype {streams.dtype}")
    block_k, block_r, block_h, chunk_r = blocks
    step_k = _pow2_block(block_k, max(16, MAX_TILE // rows))  # kernel A's step: [rows, step_k] f32 tiles fit
    dtype = streams.dtype
    f32 = jnp.float32
    x = streams.reshape(tokens, width)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=2)}

    args = [x, gamma, w_down]
    if w_inject is not None:
        args.append(w_inject)
    n_k = hidden // block_k
    # per contraction block: the down-projection partials, and the hc inject products + the sum of squares (lane hc)
    out_shape = [jax.ShapeDtypeStruct((hc, n_k, rows, rank), f32), jax.ShapeDtypeStruct((hc, n_k, rows, block_r), f32)]
    if pending is not None:
        args += [pending[0].reshape(tokens, hidden), pending[1].reshape(tokens, hc)]
        out_shape.append(jax.ShapeDtypeStruct((tokens, width), dtype))
    n_r = rank // block_r
    project = functools.partial(_project_kernel, tokens=tokens, rows=rows, hc=hc, hidden=hidden, block_k=block_k,
                                step_k=step_k, block_r=block_r, n_r=n_r, dtype=dtype,
                                has_inject=w_inject is not None, has_pending=pending is not None)
    outs = pl.pallas_call(project, grid=(hc, n_k, n_r + 1), out_shape=tuple(out_shape), interpret=interpret,
                          **kwargs)(*args)
    down, extras = outs[:2]
    if pending is not None:
        x = outs[2]

    reduce_shape = [jax.ShapeDtypeStruct((rows, rank), w_up.dtype), jax.ShapeDtypeStruct((rows, hc), f32)]
    if w_inject is not None:
        reduce_shape.append(jax.ShapeDtypeStruct((tokens, hc), dtype))
    reduce = functools.partial(_reduce_kernel, tokens=tokens, rows=rows, hc=hc, hidden=hidden, n_k=n_k,
                               block_r=block_r, eps=eps, dtype=dtype)
    reduced = pl.pallas_call(reduce, grid=(n_r,), out_shape=tuple(reduce_shape), interpret=interpret,
                             **kwargs)(down, extras)
    act, scales = reduced[:2]

    mix = functools.partial(_mix_kernel, tokens=tokens, rows=rows, hc=hc, rank=rank, block_h=block_h,
                            chunk_r=chunk_r, dtype=dtype)
    mixed = pl.pallas_call(mix, grid=(hidden // block_h,), out_shape=jax.ShapeDtypeStruct((tokens, hidden), dtype),
                           interpret=interpret, **kwargs)(x.reshape(tokens, hc, hidden), gamma.reshape(hc, hidden),
                                                          w_up.reshape(hc, hidden, rank), act, scales)
    weights = reduced[2].reshape(*lead, hc) if w_inject is not None else None
    mixed = mixed.reshape(*lead, hidden)
    return mixed, weights, x.reshape(streams.shape)
