"""The numpy quantizer of the packed 1-bit / multi-plane expert format (`pallas_kernels.onebit_format`, which holds
the type, the layout and the bit packing; docs/FORMATS.md, "Packed expert format").

A weight matrix ``w [out, in]`` (one expert's ``gate_up_proj`` or ``down_proj``, HF orientation) is
approximated by ``P`` residual bit-planes::

    w[n, k] ~= sum_p  scale[p, g(k), n] * sign[p, k, n]      sign = +1 where the bit is 1, -1 where 0
                                                             g(k) = k // group

Scales are the closed-form squared-error optimum for fixed signs, ``mean(|r|)`` over the group
(``r`` = what the previous planes left), rounded to bf16 *before* the next plane is fitted, so later
planes also absorb the rounding. ``refit_rounds`` extra rounds of alternating refit (re-fit each
plane to the residual of all the others) reduce the error further for ``planes >= 2``; each round
is a coordinate-descent step, so the error never increases (up to bf16 rounding of the scales).
A per-group offset (``w ~ o + sum_p s_p sign_p``) was measured and cut the error by < 0.5%, so it
is not part of the format. The sign bit is 1 where the residual's float sign bit is clear
(``r >= +0.0``; ``-0.0`` gets 0).
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.onebit_format import BF16, WORD_BITS, PackedExperts, num_groups, pack_signs, unpack_bits

# Default alternating-refit rounds per plane count (measured, docs/FORMATS.md): 1 plane has
# nothing to refit; for 2-4 planes 8 rounds cut the relative error by 6-16% (Gaussian) and 15-34%
# (heavy-tailed) over greedy residual fitting, at ~7x the greedy quantization time.
DEFAULT_REFIT_ROUNDS = {1: 0, 2: 8, 3: 8, 4: 8}


def _group_sizes(in_features: int, group: int) -> np.ndarray:
    starts = np.arange(0, in_features, group)
    return np.minimum(starts + group, in_features) - starts


def _to_groups(w: np.ndarray, group: int) -> np.ndarray:
    """[e, out, in] -> float32 [e, out, groups, group], zero-padded when in % group != 0."""
    e, n, k = w.shape
    ng = num_groups(k, group)
    if k == ng * group:
        return w.astype(np.float32).reshape(e, n, ng, group)
    r = np.zeros((e, n, ng * group), np.float32)
    r[..., :k] = w
    return r.reshape(e, n, ng, group)


def _fit_plane(r: np.ndarray, inv_count: np.ndarray, approx: np.ndarray, k_last: int):
    """Best single plane for residual r [e, out, g, group]; writes its values into ``approx``.

    For fixed signs the squared-error-optimal scale is mean(r * sign); the best signs for a positive
    scale are sign(r); together: scale = mean(|r|). Zero padding adds nothing to the sums.
    Returns (bit: bool, 1 where r's sign bit is clear; scales bf16 [e, out, g]).
    """
    np.abs(r, out=approx)
    s = (approx.sum(axis=-1, dtype=np.float32) * inv_count).astype(BF16)
    np.copysign(np.broadcast_to(s.astype(np.float32)[..., None], r.shape), r, out=approx)
    if k_last < r.shape[-1]:
        approx[..., -1, k_last:] = 0.0
    return ~np.signbit(r), s


def quantize_experts(
    w: np.ndarray,
    group: int = 128,
    planes: int = 1,
    *,
    refit_rounds: int | None = None,
    chunk_bytes: int = 256 << 20,
) -> PackedExperts:
    """Quantize dense expert weights ``w [E, out, in]`` into ``planes`` residual sign planes.

    ``refit_rounds=None`` uses ``DEFAULT_REFIT_ROUNDS[planes]``. Experts are processed in chunks of
    about ``chunk_bytes`` of float32 so memory stays bounded for real-size tensors.
    """
    w = np.asarray(w)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"w must be [E, out, in], got {w.shape}")
    e, n, k = w.shape
    if k % WORD_BITS:
        raise ValueError(f"in_features must be a multiple of 32, got {k}")
    if group % WORD_BITS or group <= 0:
        raise ValueError(f"group must be a positive multiple of 32, got {group}")
    if not 1 <= planes <= 8:
        raise ValueError(f"planes must be in 1..8, got {planes}")
    if refit_rounds is None:
        refit_rounds = DEFAULT_REFIT_ROUNDS.get(planes, 3)
    ng = num_groups(k, group)
    bits = np.empty((e, planes, k // WORD_BITS, n), np.uint32)
    scales = np.empty((e, planes, ng, n), BF16)
    inv_count = (1.0 / _group_sizes(k, group)).astype(np.float32)
    k_last = k - (ng - 1) * group  # inputs in the last (possibly short) group
    step = max(1, chunk_bytes // max(1, n * ng * group * 4 * (planes + 2)))
    for e0 in range(0, e, step):
        r = _to_groups(w[e0 : e0 + step], group)  # residual [e, out, g, group]
        approx = [np.empty_like(r) for _ in range(planes)]
        fit = []
        for p in range(planes):
            fit.append(_fit_plane(r, inv_count, approx[p], k_last))
            r -= approx[p]
        for _ in range(refit_rounds if planes > 1 else 0):
            for p in range(planes):
                r += approx[p]  # residual of all the other planes
                fit[p] = _fit_plane(r, inv_count, approx[p], k_last)
                r -= approx[p]
        ee = r.shape[0]
        for p, (pos, s) in enumerate(fit):
            bits[e0 : e0 + ee, p] = pack_signs(pos.reshape(ee, n, -1)[..., :k])
            scales[e0 : e0 + ee, p] = np.swapaxes(s, 1, 2)
    return PackedExperts(bits=bits, scales=scales, group=group)


def dequantize_experts(packed: PackedExperts, planes: int | None = None) -> np.ndarray:
    """PackedExperts -> float32 [E, out, in] (sum of the first ``planes`` planes; default all)."""
    p_used = packed.planes if planes is None else planes
    k = packed.in_features
    out = np.zeros(packed.shape, np.float32)
    for p in range(p_used):
        signs = np.swapaxes(unpack_bits(packed.bits[:, p]), 1, 2).astype(np.float32) * 2.0 - 1.0  # [E, out, in]
        s = np.swapaxes(packed.scales[:, p].astype(np.float32), 1, 2)  # [E, out, groups]
        out += signs * np.repeat(s, _group_sizes(k, packed.group), axis=-1)
    return out


def reconstruction_error(
    w: np.ndarray, packed: PackedExperts, *, planes: int | None = None, per_expert: bool = False
):
    """Relative Frobenius error ||w - deq|| / ||w|| (float64), overall or per expert."""
    w = np.asarray(w, np.float64)
    if w.ndim == 2:
        w = w[None]
    d = dequantize_experts(packed, planes).astype(np.float64)
    num = ((w - d) ** 2).sum(axis=(1, 2))
    den = (w**2).sum(axis=(1, 2))
    if per_expert:
        return np.sqrt(num / np.maximum(den, 1e-300))
    return float(np.sqrt(num.sum() / max(den.sum(), 1e-300)))
