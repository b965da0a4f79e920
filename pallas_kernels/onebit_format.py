"""The packed 1-bit / multi-plane expert format: its one type (`PackedExperts`), the numpy bit packing, and the jnp
unpacking every reader shares. docs/FORMATS.md ("Packed expert format", "Host tier") says the same in prose.

A dense expert stack ``w [E, N, K]`` (N outputs, K inputs, HF orientation) with ``P`` residual sign planes and scale
group ``G`` (a multiple of 32) is stored as::

    bits   uint32 [E, P, K/32, N]        bit j of word w <-> input 32*w + j (LSB first); 1 -> +scale, 0 -> -scale
    scales bf16   [E, P, ceil(K/G), N]   one scale per (input group, output channel, plane); the last group may be short

    w[e, n, 32*wd + j] = sum_p scales[e, p, (32*wd + j) // G, n] * (2 * bit(bits[e, p, wd, n], j) - 1)

Output channels are the fastest axis (a kernel tile of words x outputs is one coalesced row per word); experts and
planes the slowest (one expert is one contiguous slice).

``bits`` come in two layouts (`PackedExperts.layout`), with the same bit order:

* ``"words"``: uint32 ``[E, P, K/32, N]`` as above, little-endian. Checkpoints, the device pool and every kernel.
* ``"bytes"``: byte-major uint8 ``[E, P, K/8, N]``, row ``4w + b`` = byte ``b`` of word ``w`` = inputs
  ``32w + 8b .. 32w + 8b + 7`` (bit j = input ``32w + 8b + j``). The host tier's layout: one byte row indexes one
  256-entry table. `words_to_bytes` / `bytes_to_words` convert.

In both, element ``r`` of the input axis holds inputs ``b*r .. b*r + b - 1`` (b = the element's bits), LSB first, so
one unpacking serves both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

WORD_BITS = 32
BF16 = ml_dtypes.bfloat16
# The dtype of `bits`, and the inputs one element of it holds, per layout.
LAYOUTS = {"words": np.dtype(np.uint32), "bytes": np.dtype(np.uint8)}


def num_groups(in_features: int, group: int) -> int:
    """Scale groups along an input axis of ``in_features`` inputs (the last one may be short)."""
    return -(-in_features // group)


def _concrete(a: Any) -> bool:
    """Whether ``a`` holds values: numpy, or a jax array outside a trace. Only those are validated (JAX also rebuilds
    pytrees from tracers and placeholders)."""
    return isinstance(a, np.ndarray) or (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """One expert stack's packed sign planes and bf16 group scales, as numpy or jax arrays (module docstring).

    A JAX pytree: ``bits`` and ``scales`` are its leaves, ``group`` and ``layout`` static. Dtypes and shapes are
    checked whenever both arrays are concrete."""

    bits: Any  # uint32 [E, P, K/32, N] ("words") or uint8 [E, P, K/8, N] ("bytes")
    scales: Any  # bfloat16 [E, P, ceil(K / group), N]
    group: int
    layout: str = "words"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.group % WORD_BITS or self.group <= 0:
            raise ValueError(f"group must be a positive multiple of 32, got {self.group}")
        if _concrete(self.bits) and _concrete(self.scales):
            self._check_arrays()

    def _check_arrays(self) -> None:
        want = LAYOUTS[self.layout]
        rows = "in/32" if self.layout == "words" else "in/8"
        if np.dtype(self.bits.dtype) != want or self.bits.ndim != 4:
            raise ValueError(f"bits must be {want} [E, P, {rows}, out] ({self.layout} layout), got {self.bits.dtype} "
                             f"{self.bits.shape}")
        if np.dtype(self.scales.dtype) != np.dtype(BF16) or self.scales.ndim != 4:
            raise ValueError(f"scales must be bfloat16 [E, P, groups, out], got {self.scales.dtype} "
                             f"{self.scales.shape}")
        if self.in_features % WORD_BITS:
            raise ValueError(f"bits {self.bits.shape} ({self.layout}) do not hold whole words")
        e, p, _, n = self.bits.shape
        if tuple(self.scales.shape) != (e, p, num_groups(self.in_features, self.group), n):
            raise ValueError(f"scales shape {self.scales.shape} does not match bits {self.bits.shape} / group "
                             f"{self.group}")

    def tree_flatten(self):
        return (self.bits, self.scales), (self.group, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, *aux)

    @property
    def num_experts(self) -> int:
        return self.bits.shape[0]

    @property
    def planes(self) -> int:
        return self.bits.shape[1]

    @property
    def in_features(self) -> int:
        return self.bits.shape[2] * LAYOUTS[self.layout].itemsize * 8

    @property
    def out_features(self) -> int:
        return self.bits.shape[3]

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense shape [E, out, in] these planes approximate."""
        return (self.num_experts, self.out_features, self.in_features)

    @property
    def words_per_group(self) -> int:
        return self.group // WORD_BITS

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in (self.bits, self.scales))

    @property
    def bytes_per_expert(self) -> int:
        return self.nbytes // self.num_experts

    def expert(self, e: int) -> PackedExperts:
        """Expert ``e``'s planes as a stack of one (views, no copy)."""
        return PackedExperts(self.bits[e : e + 1], self.scales[e : e + 1], self.group, self.layout)


def check_pair(gate_up: PackedExperts, down: PackedExperts) -> None:
    """Raises ValueError unless ``gate_up`` (HF ``gate_up_proj`` [E, 2I, H], gate = first I rows) and ``down``
    (``down_proj`` [E, H, I]) are one MoE layer's experts."""
    if gate_up.out_features != 2 * down.in_features:
        raise ValueError(f"gate_up out {gate_up.out_features} != 2 * down in {down.in_features}")
    if gate_up.in_features != down.out_features:
        raise ValueError(f"gate_up in {gate_up.in_features} != down out {down.out_features}")
    if gate_up.num_experts != down.num_experts:
        raise ValueError("gate_up and down disagree on the number of experts")
    if gate_up.planes != down.planes:
        raise ValueError("gate_up and down must have the same number of planes")


# -- numpy: packing, unpacking, layouts ---------------------------------------------------------------------------


def pack_signs(positive: np.ndarray) -> np.ndarray:
    """bool [..., N, K] (HF orientation; True = bit 1 = +scale) -> uint32 words [..., K/32, N]: bit j of word w is
    input 32*w + j."""
    *lead, n, k = positive.shape
    b = np.swapaxes(positive.reshape(*lead, n, k // WORD_BITS, WORD_BITS), -3, -2)  # [..., K/32, N, 32]
    by = np.packbits(b, axis=-1, bitorder="little")  # [..., K/32, N, 4] uint8, byte i = bits 8i .. 8i+7
    return np.ascontiguousarray(by).view("<u4")[..., 0].astype(np.uint32, copy=False)


def unpack_bits(bits: np.ndarray) -> np.ndarray:
    """Packed bits of either layout (uint32 words [..., K/32, N] or byte-major uint8 [..., K/8, N]) -> uint8 0/1
    [..., K, N]: input k of output n."""
    *lead, rows, n = bits.shape
    size = bits.dtype.itemsize
    by = np.ascontiguousarray(bits.astype(f"<u{size}", copy=False)).view(np.uint8).reshape(*lead, rows, n, size)
    b = np.unpackbits(by, axis=-1, bitorder="little")  # [..., rows, N, 8 * size]
    return np.swapaxes(b, -1, -2).reshape(*lead, rows * 8 * size, n)


def byte_rows(bits: np.ndarray) -> np.ndarray:
    """Packed bits of either layout -> a uint8 view [..., K/32, 4, N], entry (w, b, n) = byte b of word w (inputs
    32w + 8b .. 32w + 8b + 7): the words' little-endian bytes in place (strided), or byte-major rows reshaped."""
    *lead, rows, n = bits.shape
    if bits.dtype == np.uint8:
        return bits.reshape(*lead, rows // 4, 4, n)
    return np.swapaxes(bits.view(np.uint8).reshape(*lead, rows, n, 4), -1, -2)


def words_to_bytes(bits: np.ndarray) -> np.ndarray:
    """Packed words uint32 [..., K/32, N] -> byte-major uint8 [..., K/8, N] (row 4w + b = byte b of word w)."""
    *lead, kw, n = bits.shape
    return np.ascontiguousarray(byte_rows(np.asarray(bits))).reshape(*lead, kw * 4, n)


def bytes_to_words(byts: np.ndarray) -> np.ndarray:
    """The inverse of `words_to_bytes`: uint8 [..., K/8, N] -> uint32 [..., K/32, N]."""
    *lead, rows, n = byts.shape
    words = np.ascontiguousarray(np.swapaxes(byte_rows(np.asarray(byts)), -1, -2)).view(np.uint32)
    return words.reshape(*lead, rows // 4, n)


# -- jnp: unpacking and dequantizing ------------------------------------------------------------------------------


def unpack_signs(bits: jax.Array) -> jax.Array:
    """Packed bits of either layout, [..., K/b, N] (b = 32 for words, 8 for bytes) -> float32 +-1 [..., K, N]."""
    width = jnp.dtype(bits.dtype).itemsize * 8
    j = jnp.arange(width, dtype=bits.dtype)[:, None]
    b = (bits[..., :, None, :] >> j) & jnp.asarray(1, bits.dtype)  # [..., K/b, b, N]
    b = b.reshape(*bits.shape[:-2], bits.shape[-2] * width, bits.shape[-1])
    return b.astype(jnp.float32) * 2.0 - 1.0


def expand_scales(scales: jax.Array, group: int, in_features: int) -> jax.Array:
    """[..., groups, N] -> float32 [..., K, N] (each group's scale repeated over its inputs)."""
    s = jnp.repeat(scales.astype(jnp.float32), group, axis=-2)
    return s[..., :in_features, :]


def dequantize_planes(bits: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    """bits [..., P, K/b, N] (either layout) and scales [..., P, groups, N] -> float32 [..., K, N], the planes' sum
    (the stored orientation: input-major)."""
    k = bits.shape[-2] * jnp.dtype(bits.dtype).itemsize * 8
    return jnp.sum(unpack_signs(bits) * expand_scales(scales, group, k), axis=-3)


def dequantize(w: PackedExperts, ids: jax.Array | None = None) -> jax.Array:
    """Dense float32 weights [..., N, K] (HF orientation) of all experts, or of experts ``ids``."""
    bits, scales = (w.bits, w.scales) if ids is None else (w.bits[ids], w.scales[ids])
    return jnp.swapaxes(dequantize_planes(bits, scales, w.group), -1, -2)
