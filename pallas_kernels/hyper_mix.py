"""One hyper-connection call (the block-input mix, its inject weights, and a pending injection) as two Pallas kernels
beside its jnp form.

For streams ``x [T, hc*H]`` (stream s in columns ``s*H .. s*H+H-1``), norm weight ``gamma [hc*H]`` and the
projections ``w_down [R, hc*H]``, ``w_up [hc*H, R]``, ``w_inject [hc, hc*H]`` (torch layout)::

    normed   = RMSNorm_s(x) * (1 + gamma)                  (per stream group of H, rounded to x.dtype)
    mix      = sigmoid(silu(normed @ w_down.T / hc) @ w_up.T)
    mixed    = mean_s(mix * normed)                        [T, H]
    inject_w = 2 * sigmoid(normed @ w_inject.T / hc)       [T, hc]

At decode the jnp form is ~9 small XLA kernels per call, each costing a 4-5 us launch on an H200 for well under a
microsecond of work. Here one call is two ``pallas_call``s and no XLA op (the injection that precedes the call in
the model, ``x + block_out * w``, is folded into the first):

* The norm is per stream group and a group is a contiguous range of the contraction axis, so a projection of
  ``normed`` splits into per-group projections of the un-normalised input, scaled afterwards:
  ``normed @ W.T = sum_s rsqrt(mean_s(x^2) + eps) * (x_s * (1 + gamma_s)) @ W_s.T``. Kernel A (``_project_kernel``,
  grid ``(hc, H/block_k, R/block_r + 1)``) computes those products without waiting for the norm, one contraction
  block per program: program ``(s, kc, j)`` takes block kc of group s and either down-projection rows
  ``j*block_r ..`` (one ``[Tp, block_k] x [block_k, block_r]`` dot) or, for the last j, the block's sum of squares
  and inject products (plus the write of the injected streams). Its output is one partial per block: 420 programs
  at the real shape (hc 4, H 2560, R 320, block_k 512), none waiting on a chain of loads. The first version gave a
  program the whole group (84 programs of 20 dependent steps) and measured 2-3x slower than XLA (docs/PERF.md).
* Kernel B (``_mix_kernel``, grid ``(H/block_h,)``) adds kernel A's partials in a fixed order (no atomics, nothing
  for XLA between the kernels, bit-reproducible results), finishes the norm from the sums of squares, forms
  ``silu(down / hc)`` (each program recomputes it: ``hc * T * R`` floats, cheaper than a launch), runs the up
  projection for its columns of all hc streams, recomputes ``normed`` for those columns and writes ``mixed``.
  Program 0 also finishes the inject weights.

Tokens: Triton blocks are powers of two and ``tl.dot`` needs M >= 16, so the kernels work on ``Tp =
max(16, next_pow2(T))`` rows with masked loads and stores (no padded copies of the inputs, which would each be
another launch). Rounding: the reference rounds to the model dtype after every op; the kernels do the same (a cast
is free) except inside the down / inject projections, which see ``x * (1 + gamma)`` (the norm comes after)
instead of the rounded ``normed``. The down projection is a dot with operands in the weight dtype, float32
accumulation (float32 weights: IEEE, not TF32); the hc inject products are float32 multiply + sum, not a dot
(N = hc < 16 is too narrow for ``tl.dot``, and they are cheap in the one program per group that does them).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

IMPLS = ("auto", "jnp", "pallas")
MAX_TOKENS = 64  # the kernels keep [Tp, block] tiles of every stream in registers
# The first version measured slower than XLA's ~9 fusions on an H200 (docs/PERF.md, "Fused hyper-connection
# kernels", 2026-11-30: ~42 + ~20 us per call against ~26, the 1-slot step 10.1 -> 13.5 ms). This version (one
# contraction block per program) has not been measured yet. Until it beats XLA in `bench --mode hyper` and in the
# step, "auto" keeps the jnp form; impl="pallas" runs the kernels.
AUTO_PALLAS = False
BLOCK_K = 512
BLOCK_R = 16
BLOCK_H = 32
CHUNK_R = 64
MAX_TILE = 8192
_NT = (((1,), (1,)), ((), ()))  # x @ w.T with w in torch layout [out, in]


def inject(streams: jax.Array, block_out: jax.Array, weights: jax.Array) -> jax.Array:
    """streams [.., hc*H] + block_out [.., H] broadcast to every stream, scaled per stream by weights [.., hc]."""
    added = block_out[..., None, :] * weights[..., :, None]
    return streams + added.reshape(streams.shape)


def _silu(x):
    return x * jax.nn.sigmoid(x)


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
    mix = _silu(_linear(normed, w_down) / hc)
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


def _blocks(hidden: int, rank: int, block_k: int = BLOCK_K):
    """(block_k, block_r, block_h, chunk_r) for these shapes, or None when the kernels cannot tile them."""
    blocks = (_pow2_block(hidden, block_k), _pow2_block(rank, BLOCK_R), _pow2_block(hidden, BLOCK_H),
              _pow2_block(rank, CHUNK_R))
    return None if None in blocks else blocks


def resolve_impl(impl: str, tokens: int, hidden: int, rank: int) -> str:
    """"auto": the jnp form while ``AUTO_PALLAS`` is off (the first version measured slower than XLA; this one is
    not yet measured). With it on, the
    Pallas kernels on a GPU for at most ``MAX_TOKENS`` tokens when H and R have power-of-two blocks of at least 16
    (Triton's block and dot constraints)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        ok = (AUTO_PALLAS and jax.default_backend() == "gpu" and tokens <= MAX_TOKENS
              and _blocks(hidden, rank) is not None)
        return "pallas" if ok else "jnp"
    return impl


def _round(x, dtype):
    """x rounded to dtype and back to float32: the reference's rounding points."""
    return x.astype(dtype).astype(jnp.float32)


def _project_kernel(*refs, tokens, rows, hc, hidden, block_k, block_r, n_r, extra, dtype, has_inject, has_pending):
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
    # One contraction block per program: no chain of dependent loads inside a program (the first version walked
    # the whole group in one program and waited on memory at every step); kernel B adds the blocks' partials.
    k = pl.multiple_of(kc * block_k, block_k)
    col = pl.multiple_of(s * hidden + k, block_k)
    x = pltriton.load(x_ref.at[pl.ds(0, rows), pl.ds(col, block_k)], mask=row_ok, other=0.0).astype(f32)
    if has_pending:
        pw = pltriton.load(pw_ref.at[pl.ds(0, rows), s], mask=row_ok[:, 0], other=0.0).astype(f32)[:, None]
        b = pltriton.load(b_ref.at[pl.ds(0, rows), pl.ds(k, block_k)], mask=row_ok, other=0.0).astype(f32)
        x = _round(x + _round(b * pw, dtype), dtype)
    xs = x * (1.0 + g_ref[pl.ds(col, block_k)].astype(f32))[None, :]

    @pl.when(j < n_r)
    def _down():
        r0 = pl.multiple_of(j * block_r, block_r)
        w = wd_ref[pl.ds(r0, block_r), pl.ds(col, block_k)]
        down_ref[s, kc, :, pl.ds(r0, block_r)] = jax.lax.dot_general(
            xs.astype(w.dtype), w, _NT, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)

    @pl.when(j == n_r)
    def _extras():
        if has_pending:
            pltriton.store(ns_ref.at[pl.ds(0, rows), pl.ds(col, block_k)], x.astype(ns_ref.dtype), mask=row_ok)
        lane = jnp.arange(extra)[None, :]
        acc = jnp.where(lane == hc, jnp.sum(x * x, axis=1)[:, None], 0.0)
        if has_inject:
            for h in range(hc):
                w = wi_ref[h, pl.ds(col, block_k)].astype(f32)
                acc = acc + jnp.where(lane == h, jnp.sum(xs * w[None, :], axis=1)[:, None], 0.0)
        extra_ref[s, kc] = acc


def _mix_kernel(x_ref, g_ref, wu_ref, down_ref, extra_ref, mixed_ref, *inj_ref, tokens, rows, hc, hidden, rank,
                n_k, block_h, chunk_r, extra, eps, dtype):
    f32 = jnp.float32
    c = pl.program_id(0)
    c0 = pl.multiple_of(c * block_h, block_h)
    row_ok = jnp.arange(rows)[:, None] < tokens
    # kernel A's per-block partials, added in a fixed order (deterministic)
    rs = [jax.lax.rsqrt(sum(extra_ref[s, q, :, hc] for q in range(n_k)) / hidden + eps)[:, None] for s in range(hc)]

    # Written out over R (no loop), so that every chunk's partial and weight loads can be in flight together.
    ups = [jnp.zeros((rows, block_h), f32) for _ in range(hc)]
    for q in range(rank // chunk_r):
        r0 = q * chunk_r
        down = sum(sum(down_ref[s, kq, :, pl.ds(r0, chunk_r)] for kq in range(n_k)) * rs[s] for s in range(hc))
        v = _round(_round(down, dtype) / hc, dtype)
        act = (v * _round(jax.nn.sigmoid(v), dtype)).astype(wu_ref.dtype)
        ups = [ups[s] + jax.lax.dot_general(act, wu_ref[pl.ds(s * hidden + c0, block_h), pl.ds(r0, chunk_r)], _NT,
                                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
               for s in range(hc)]
    acc = jnp.zeros((rows, block_h), f32)
    for s in range(hc):
        col = pl.multiple_of(s * hidden + c0, block_h)
        x = pltriton.load(x_ref.at[pl.ds(0, rows), pl.ds(col, block_h)], mask=row_ok, other=0.0).astype(f32)
        normed = _round(x * rs[s] * (1.0 + g_ref[pl.ds(col, block_h)].astype(f32))[None, :], dtype)
        acc = acc + _round(_round(jax.nn.sigmoid(_round(ups[s], dtype)), dtype) * normed, dtype)
    pltriton.store(mixed_ref.at[pl.ds(0, rows), pl.ds(c0, block_h)], (acc / hc).astype(mixed_ref.dtype),
                   mask=row_ok)

    if inj_ref:
        @pl.when(c == 0)
        def _inject():
            logits = _round(sum(sum(extra_ref[s, q] for q in range(n_k)) * rs[s] for s in range(hc)), dtype)
            w = 2.0 * _round(jax.nn.sigmoid(_round(logits / hc, dtype)), dtype)
            lane = jnp.arange(extra)[None, :]
            pltriton.store(inj_ref[0].at[pl.ds(0, rows), pl.ds(0, extra)], w.astype(inj_ref[0].dtype),
                           mask=row_ok & (lane < hc))


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

    ``impl``: "jnp", "pallas" or "auto" (``resolve_impl``, on the flattened token count). ``block_k`` (kernel A's
    contraction step, at most this power of two; default ``BLOCK_K``, capped so that a [T, block_k] float32 tile stays
    within ``MAX_TILE`` elements) and ``num_warps`` tune the kernels. ``interpret`` runs the kernels in Pallas
    interpret mode (CPU tests)."""
    _check_shapes(streams, gamma, w_down, w_up, w_inject, hc, pending)
    lead, width = streams.shape[:-1], streams.shape[-1]
    hidden, rank, tokens = width // hc, w_down.shape[0], math.prod(lead)
    # The kernels round the injection to the streams dtype; the jnp form promotes mixed dtypes instead.
    same_dtype = pending is None or all(a.dtype == streams.dtype for a in pending)
    if impl == "auto" and not same_dtype or resolve_impl(impl, tokens, hidden, rank) == "jnp":
        return hyper_mix_jnp(streams, gamma, w_down, w_up, w_inject, hc=hc, eps=eps, pending=pending)
    rows = max(16, pl.next_power_of_2(tokens))
    # By default kernel A's [rows, block_k] float32 tiles stay within MAX_TILE elements (4 warps, no spills at 64 rows).
    blocks = _blocks(hidden, rank, block_k or min(BLOCK_K, MAX_TILE // rows))
    if blocks is None or tokens > MAX_TOKENS:
        raise ValueError(f"the Pallas hyper_mix needs H and R with power-of-two blocks of at least 16 dividing them "
                         f"and at most {MAX_TOKENS} tokens, got H={hidden}, R={rank}, T={tokens}")
    if not same_dtype:
        raise ValueError(f"the Pallas hyper_mix needs the pending injection in the streams dtype {streams.dtype}")
    block_k, block_r, block_h, chunk_r = blocks
    extra = pl.next_power_of_2(hc + 1)  # the hc inject products and the sum of squares, one lane each
    dtype = streams.dtype
    f32 = jnp.float32
    x = streams.reshape(tokens, width)
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=2)}

    args = [x, gamma, w_down]
    if w_inject is not None:
        args.append(w_inject)
    n_k = hidden // block_k
    out_shape = [jax.ShapeDtypeStruct((hc, n_k, rows, rank), f32), jax.ShapeDtypeStruct((hc, n_k, rows, extra), f32)]
    if pending is not None:
        args += [pending[0].reshape(tokens, hidden), pending[1].reshape(tokens, hc)]
        out_shape.append(jax.ShapeDtypeStruct((tokens, width), dtype))
    n_r = rank // block_r
    project = functools.partial(_project_kernel, tokens=tokens, rows=rows, hc=hc, hidden=hidden, block_k=block_k,
                                block_r=block_r, n_r=n_r, extra=extra, dtype=dtype,
                                has_inject=w_inject is not None, has_pending=pending is not None)
    outs = pl.pallas_call(project, grid=(hc, n_k, n_r + 1), out_shape=tuple(out_shape), interpret=interpret,
                          **kwargs)(*args)
    down, extras = outs[:2]
    if pending is not None:
        x = outs[2]

    out_shape = [jax.ShapeDtypeStruct((tokens, hidden), dtype)]
    if w_inject is not None:
        out_shape.append(jax.ShapeDtypeStruct((tokens, hc), dtype))
    mix = functools.partial(_mix_kernel, tokens=tokens, rows=rows, hc=hc, hidden=hidden, rank=rank, n_k=n_k,
                            block_h=block_h, chunk_r=chunk_r, extra=extra, eps=eps, dtype=dtype)
    outs = pl.pallas_call(mix, grid=(hidden // block_h,), out_shape=tuple(out_shape), interpret=interpret,
                          **kwargs)(x, gamma, w_up, down, extras)
    mixed = outs[0].reshape(*lead, hidden)
    weights = outs[1].reshape(*lead, hc) if w_inject is not None else None
    return mixed, weights, x.reshape(streams.shape)
