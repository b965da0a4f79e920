"""The MoE router of a few tokens (decode and verify windows) as two Pallas kernels beside its XLA form.

For tokens ``x [T, H]`` and the router weight ``w [E, H]`` (torch layout), as ``strata_jax.model.moe`` routes::

    logits  = x @ w.T                         (in w's dtype: float32 accumulation, rounded to w.dtype)
    probs   = softmax(float32(logits))
    weights, ids = top_k(probs, k)            (ties to the lower expert, as lax.top_k)
    weights = weights / sum(weights)          (with normalize, Qwen's norm_topk_prob)

At decode XLA runs this as a (split-K) GEMM, its reduction, the softmax, the top-k and the normalisation: four to six
kernels per layer. Here it is two ``pallas_call``s and no XLA op:

* ``_logits_kernel``, grid ``(Ep/block_e, ceil(H/block_k))``: program ``(e, c)`` contracts columns block c of x with
  experts ``e*block_e ..`` and writes its float32 partial ``[16, block_e]``. Walking the contraction in
  ``step_k`` steps keeps the tiles in registers; masked loads read no padding (any E and H).
* ``_select_kernel``, one program: adds the partials in a fixed order (no atomics: bit-reproducible), rounds them to
  the weight dtype (the XLA GEMM's output), and runs the softmax's max and sum, k rounds of max + lowest index of
  the max, and the normalisation on a ``[16, Ep]`` tile in registers.

One kernel would need every program's logits before the top-k: a grid-wide barrier, or the "last program to
arrive" pattern, which needs a block barrier before its atomic that the Triton lowering does not expose. Two
launches it is.

Selection is by probability, as XLA's: ties (equal logits, or logits so far below the best that their
probabilities are zero) go to the lower expert. The softmax's sum is added in another order than XLA's, so the
weights equal XLA's up to float32 rounding (a few ulps), and the ids are identical unless two probabilities lie
within those ulps of each other (float32 logits one ulp apart; with bf16 logits that cannot happen). On inputs whose
products are exact (integer-valued, as the tests use to check ties) the ids are identical. That holds where XLA's
GEMM sums in float32 and rounds once (the CPU). XLA's bf16 GEMM on the GPU rounds differently: on the H200
(2026-12-02) its logits were a bf16 step off the exactly rounded ones often enough to swap experts of near-equal
logits (4 of 10 for one token) and move weights by up to 1%. The kernel's GPU test therefore checks it against
float64 numpy rounded once to bf16 (tests/kernels/test_fused_router.py; it passed on the H200 on
2026-12-02 for 1, 5 and 16 tokens). Both paths are valid roundings of the same bf16 logits; they need not agree.

Tokens: ``tl.dot`` needs M >= 16, so the kernels work on 16 rows with masked loads and stores; at most
``MAX_TOKENS`` (16) tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fused_matvec import MAX_TOKENS, resolve_impl  # one switch for the fused decode kernels

ROWS = 16  # tl.dot's smallest M
_NT = (((1,), (1,)), ((), ()))  # x @ w.T with w in torch layout [out, in]


@functools.lru_cache(maxsize=None)
def default_blocks(num_experts: int, hidden: int) -> tuple[int, int, int]:
    """(block_e, block_k, step_k). Not yet tuned on a device (docs/PERF.md, "Fused decode kernels"): 32 experts x
    512 columns per program (80 programs of 32 KB of bf16 weights at Flash-Next's 512 x 2560, ~one wave on an
    H200), walked in steps of 128 columns."""
    del num_experts, hidden
    return 32, 512, 128


def route_xla(x: jax.Array, w: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """The reference: the model's router and `route` (no selection bias), op for op. x [T, H], w [E, H] ->
    (ids [T, k] int32, weights [T, k] float32)."""
    logits = jnp.einsum("nh,eh->ne", x.astype(w.dtype), w)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def _logits_kernel(x_ref, w_ref, part_ref, *, tokens, hidden, experts, block_e, block_k, step_k):
    f32 = jnp.float32
    e, c = pl.program_id(0), pl.program_id(1)
    e0 = pl.multiple_of(e * block_e, block_e)
    row_ok = (jnp.arange(ROWS) < tokens)[:, None]
    expert_ok = (e0 + jnp.arange(block_e) < experts)[:, None]
    w_dtype = w_ref.dtype

    def step(i, acc):
        k0 = pl.multiple_of(c * block_k + i * step_k, step_k)
        col_ok = (k0 + jnp.arange(step_k) < hidden)[None, :]
        x = pltriton.load(x_ref.at[pl.ds(0, ROWS), pl.ds(k0, step_k)], mask=row_ok & col_ok, other=0.0)
        w = pltriton.load(w_ref.at[pl.ds(e0, block_e), pl.ds(k0, step_k)], mask=expert_ok & col_ok, other=0.0)
        return acc + jax.lax.dot_general(x.astype(w_dtype), w, _NT, precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, block_k // step_k, step, jnp.zeros((ROWS, block_e), f32))
    part_ref[c, :, pl.ds(e0, block_e)] = acc


def _select_kernel(part_ref, *refs, tokens, experts, padded, n_k, top_k, k_pad, normalize, dtype):
    ids_ref, weights_ref = refs[-2:]  # a poisoned call has its two aliased inputs first
    f32 = jnp.float32
    logits = part_ref[0]
    for c in range(1, n_k):  # a fixed order: the same sums every call
        logits = logits + part_ref[c]
    logits = logits.astype(dtype).astype(f32)  # the XLA GEMM's output dtype
    lane = jax.lax.broadcasted_iota(jnp.int32, (ROWS, padded), 1)
    scores = jnp.where(lane < experts, logits, -jnp.inf)
    unnormalized = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
    # Selected by probability as XLA does: logits far below the best give equal (zero) probabilities, and those
    # ties go to the lower expert.
    scores = jnp.where(lane < experts, unnormalized / jnp.sum(unnormalized, axis=1, keepdims=True), -jnp.inf)
    col = jax.lax.broadcasted_iota(jnp.int32, (ROWS, k_pad), 1)
    ids = jnp.zeros((ROWS, k_pad), jnp.int32)
    probs = jnp.zeros((ROWS, k_pad), f32)
    for j in range(top_k):  # k is small and static: unrolled
        best = jnp.max(scores, axis=1, keepdims=True)
        idx = jnp.min(jnp.where(scores == best, lane, padded), axis=1, keepdims=True)
        ids = jnp.where(col == j, idx, ids)
        probs = jnp.where(col == j, best, probs)
        scores = jnp.where(lane == idx, -jnp.inf, scores)
    if normalize:
        probs = probs / jnp.sum(probs, axis=1, keepdims=True)
    ok = (jnp.arange(ROWS)[:, None] < tokens) & (col < top_k)
    pltriton.store(ids_ref.at[pl.ds(0, ROWS), pl.ds(0, k_pad)], ids, mask=ok)
    pltriton.store(weights_ref.at[pl.ds(0, ROWS), pl.ds(0, k_pad)], probs, mask=ok)


def fused_route(x: jax.Array, w: jax.Array, top_k: int, normalize: bool, *, impl: str = "auto",
                blocks: tuple[int, int, int] | None = None, num_warps: int = 4, interpret: bool = False,
                poison: bool = False) -> tuple[jax.Array, jax.Array]:
    """The router of T tokens: x [.., H] (leading axes flattened to T), w [E, H] -> (ids [T, k] int32, weights
    [T, k] float32), equal to ``route_xla`` (the module docstring says how exactly).

    ``impl``: "xla", "pallas" or "auto" (``resolve_impl``). ``blocks`` = (block_e, block_k, step_k), powers of two
    with step_k dividing block_k (default ``default_blocks``); ``num_warps`` tunes the kernels. ``interpret`` runs
    them in Pallas interpret mode (CPU tests); ``poison`` (testing aid) starts the outputs as -1 / NaN so that
    unwritten elements show."""
    hidden = x.shape[-1]
    x = x.reshape(-1, hidden)
    tokens = x.shape[0]
    if w.ndim != 2 or w.shape[1] != hidden:
        raise ValueError(f"router weight {w.shape} does not fit tokens of width {hidden}")
    experts = w.shape[0]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    if resolve_impl(impl, tokens) == "xla":
        return route_xla(x, w, top_k, normalize)
    if tokens > MAX_TOKENS:
        raise ValueError(f"the Pallas router takes at most {MAX_TOKENS} tokens, got {tokens}")
    block_e, block_k, step_k = blocks or default_blocks(experts, hidden)
    if any(b & (b - 1) or b < 16 for b in (block_e, block_k, step_k)) or block_k % step_k:
        raise ValueError(f"blocks must be powers of two >= 16 with step_k dividing block_k, got {blocks}")
    padded = max(pl.next_power_of_2(experts), block_e)
    n_k = -(-hidden // block_k)
    f32 = jnp.float32
    kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=2)}
    # The selection holds a few [16, Ep] float32 tiles: 8 warps keep them in registers at Ep = 512.
    select_kwargs = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=8, num_stages=1)}
    logits = functools.partial(_logits_kernel, tokens=tokens, hidden=hidden, experts=experts, block_e=block_e,
                               block_k=block_k, step_k=step_k)
    partials = pl.pallas_call(logits, grid=(padded // block_e, n_k),
                              out_shape=jax.ShapeDtypeStruct((n_k, ROWS, padded), f32), interpret=interpret,
                              **kwargs)(x, w)
    select = functools.partial(_select_kernel, tokens=tokens, experts=experts, padded=padded, n_k=n_k, top_k=top_k,
                               k_pad=max(pl.next_power_of_2(top_k), 16), normalize=normalize, dtype=w.dtype)
    out_shape = (jax.ShapeDtypeStruct((tokens, top_k), jnp.int32), jax.ShapeDtypeStruct((tokens, top_k), f32))
    args = [partials]
    if poison:
        args += [jnp.full((tokens, top_k), -1, jnp.int32), jnp.full((tokens, top_k), jnp.nan, f32)]
        select_kwargs["input_output_aliases"] = {1: 0, 2: 1}
    ids, weights = pl.pallas_call(select, grid=(1,), out_shape=out_shape, interpret=interpret,
                                  **select_kwargs)(*args)
    return ids, weights

