"""Explicit, fixed-shape cache pytrees. Every array is [batch, ...]; steps take a cache and return a new one.

- attention layers: K and V for `max_len` positions (+ the QSA indexer's raw keys and its finished block keys);
  K and V may be stored quantized (int8 or fp8 e4m3, `KV_DTYPES`) with one float32 scale per (kv head, position);
- Gated DeltaNet layers: the causal-conv tail (K-1 inputs) and the float32 recurrent state [Hv, Dk, Dv];
- PLE layers: the tail of the dilated conv; the n-gram token context stays on the host (it is token ids).
`lengths[b]` is how many tokens row b has consumed; positions of new tokens start there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.decode_attention import is_quantized
from strata_jax.model.config import ModelConfig

# Quantized KV cache dtypes by name (`init_cache(kv_dtype=...)`, EngineConfig.cache_dtype "int8" / "fp8"). Only K and
# V are quantized: the QSA index keys and block keys stay in the cache dtype (they are 1/8 and 1/32 of a bf16 KV at
# Flash-Next's shapes and decide which blocks are attended: a rounding there changes the selection, not a value),
# and Gated DeltaNet's recurrent state stays float32 (it is a running sum rewritten every token: quantizing it
# would compound the error at every step, and at a fixed [Hv, Dk, Dv] per slot it does not grow with the context).
KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@struct.dataclass
class AttentionCache:
    # Heads before positions: the attention dots batch over (slot, kv head), and XLA transposes a cache whose batch
    # dims are not major -- the whole cache, every step (3.6 ms of a 32-slot H200 step at 4K context).
    k: jax.Array  # [B, kv_heads, S, head_dim]
    v: jax.Array  # [B, kv_heads, S, head_dim]
    index_k: jax.Array | None  # [B, S, indexer_head_dim] raw (un-normalised) QSA keys
    # [B, S // compress_ratio, indexer_head_dim]: each block's pooled, normalised and roped key, written by the step
    # whose tokens complete the block. Blocks below length // compress_ratio always hold their keys' pool; the others
    # may hold anything (zeros, or a block a rejected draft completed): they are never selected, and are rewritten
    # when real tokens complete them.
    block_keys: jax.Array | None = None
    compress_ratio: int = struct.field(pytree_node=False, default=1)
    # [B, kv_heads, S] float32 when k and v are quantized (int8 / fp8): position s of head h holds k[:, h, s] *
    # k_scale[:, h, s] (pallas_kernels.decode_attention.quantize_kv). None for a float cache.
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    def map_positions(self, fn) -> "AttentionCache":
        """Applies fn(array, position_axis) to every array (e.g. to cut or pad the positions).

        The block keys go through fn as a view with one row per position (block n's features spread over positions
        n * c .. n * c + c - 1), so a cut to L positions keeps the L // c blocks that L positions complete and a pad
        to S positions restores all S // c: snapshots and prefix reads carry the prefix's blocks only (whole, they
        would add 48 MiB to each at flash-next's 65,536 positions). If indexer_head_dim is not a multiple of c
        there is no such view and they are left whole (correct, only larger)."""
        bk, view = self.block_keys, self._block_key_view()
        if view is not None:
            c = self.compress_ratio
            out = fn(bk.reshape(view), 1)
            bk = out[:, : out.shape[1] // c * c].reshape(bk.shape[0], -1, bk.shape[2])
        scales = {}
        if self.k_scale is not None:  # [B, kv_heads, S]: the same position axis as k and v
            scales = dict(k_scale=fn(self.k_scale, KV_POSITION_AXIS), v_scale=fn(self.v_scale, KV_POSITION_AXIS))
        return self.replace(k=fn(self.k, KV_POSITION_AXIS), v=fn(self.v, KV_POSITION_AXIS),
                            index_k=None if self.index_k is None else fn(self.index_k, 1), block_keys=bk, **scales)

    def _block_key_view(self) -> tuple[int, int, int] | None:
        """The shape of the block keys seen one row per position ([B, NB * c, d // c]), None without such a view."""
        if self.block_keys is None:
            return None
        b, n, d = self.block_keys.shape
        c = self.compress_ratio
        return (b, n * c, d // c) if d % c == 0 else None

    def position_lengths(self) -> set[int]:
        """The position-axis lengths `map_positions` would hand fn, read from the shapes alone (no array op)."""
        out = {self.k.shape[KV_POSITION_AXIS], self.v.shape[KV_POSITION_AXIS]}
        if self.index_k is not None:
            out.add(self.index_k.shape[1])
        view = self._block_key_view()
        if view is not None:
            out.add(view[1])
        if self.k_scale is not None:
            out |= {self.k_scale.shape[KV_POSITION_AXIS], self.v_scale.shape[KV_POSITION_AXIS]}
        return out


KV_POSITION_AXIS = 2


@struct.dataclass
class DeltaNetCache:
    conv: jax.Array  # [B, conv_dim, kernel-1]
    state: jax.Array  # [B, v_heads, k_dim, v_dim] float32


@struct.dataclass
class PleCache:
    conv: jax.Array  # [B, hc*hidden, (kernel-1)*dilation]


@struct.dataclass
class LayerCache:
    mixer: AttentionCache | DeltaNetCache
    ple: PleCache | None = None


@struct.dataclass
class ModelCache:
    layers: tuple[LayerCache, ...]
    lengths: jax.Array  # [B] int32
    mtp: LayerCache | None = None
    mtp_lengths: jax.Array | None = None  # [B] int32: tokens the MTP layer has consumed

    @property
    def max_len(self) -> int:
        for layer in self.layers:
            if isinstance(layer.mixer, AttentionCache):
                return layer.mixer.k.shape[KV_POSITION_AXIS]
        return 1 << 30  # no attention layer: unbounded


def map_kv_positions(cache: ModelCache, fn) -> ModelCache:
    """`cache` with fn(array, position_axis) applied to every attention layer's arrays (the MTP layer's too): to
    cut the positions to a prefix or pad them back."""
    layers = []
    for layer in cache.layers:
        mixer = layer.mixer
        if isinstance(mixer, AttentionCache):
            mixer = mixer.map_positions(fn)
        layers.append(layer.replace(mixer=mixer))
    cache = cache.replace(layers=tuple(layers))
    if cache.mtp is not None and isinstance(cache.mtp.mixer, AttentionCache):
        cache = cache.replace(mtp=cache.mtp.replace(mixer=cache.mtp.mixer.map_positions(fn)))
    return cache


def kv_position_lengths(cache: ModelCache) -> set[int]:
    """Every position-axis length `map_kv_positions` would hand its fn, from the shapes alone: mapping device
    arrays to read them runs eager ops (the block keys' reshapes), each compiled on first use of its shape."""
    mixers = [layer.mixer for layer in cache.layers] + ([cache.mtp.mixer] if cache.mtp is not None else [])
    return set().union(*(m.position_lengths() for m in mixers if isinstance(m, AttentionCache)))


def take_rows(tree, rows: jax.Array):
    """The rows `rows` [P] of every array of `tree` (a cache or part of one: batch-major arrays), stacked in that
    order (batch dimension P). Dynamic slices: an index past the batch is clipped to its last row."""
    if rows.shape[0] == 1:
        return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, rows[0], 1, axis=0), tree)
    return jax.tree_util.tree_map(
        lambda x: jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, rows[p], 1, axis=0)
                                   for p in range(rows.shape[0])], axis=0), tree)


def put_rows(tree, rows: jax.Array, sub):
    """`tree` with rows `rows` [P] replaced by the P rows of `sub` (as `take_rows` took them), written in order:
    of two equal (or clipped) indices the later row wins. Dynamic update slices, in place in a donated buffer."""
    for p in range(rows.shape[0]):
        tree = jax.tree_util.tree_map(
            lambda x, y, p=p: jax.lax.dynamic_update_slice_in_dim(x, jax.lax.slice_in_dim(y, p, p + 1, axis=0),
                                                                  rows[p], axis=0), tree, sub)
    return tree


def cache_len_for(cfg: ModelConfig, max_len: int) -> int:
    """Attention cache length: `max_len` rounded up to whole QSA blocks."""
    c = cfg.indexer_compress_ratio if cfg.qsa else 1
    return -(-max_len // c) * c


def kv_dtype_of(name: str | None):
    """The KV storage dtype for a cache dtype name: int8 / float8_e4m3fn for "int8" / "fp8", else None (K and V
    in the cache's float dtype)."""
    return KV_DTYPES.get(name) if name else None


def _attention_cache(cfg: ModelConfig, batch: int, s: int, dtype: jnp.dtype, kv_dtype=None) -> AttentionCache:
    shape = (batch, cfg.num_kv_heads, s, cfg.head_dim)
    kv = dtype if kv_dtype is None else kv_dtype
    scales = {}
    if is_quantized(kv):
        scales = dict(k_scale=jnp.zeros(shape[:3], jnp.float32), v_scale=jnp.zeros(shape[:3], jnp.float32))
    if not cfg.qsa:
        return AttentionCache(k=jnp.zeros(shape, kv), v=jnp.zeros(shape, kv), index_k=None, **scales)
    c = cfg.indexer_compress_ratio
    return AttentionCache(k=jnp.zeros(shape, kv), v=jnp.zeros(shape, kv),
                          index_k=jnp.zeros((batch, s, cfg.indexer_head_dim), dtype),
                          block_keys=jnp.zeros((batch, s // c, cfg.indexer_head_dim), dtype), compress_ratio=c,
                          **scales)


def _deltanet_cache(cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> DeltaNetCache:
    conv_dim = 2 * cfg.linear_num_k_heads * cfg.linear_k_dim + cfg.linear_num_v_heads * cfg.linear_v_dim
    return DeltaNetCache(
        conv=jnp.zeros((batch, conv_dim, cfg.linear_conv_kernel - 1), dtype),
        state=jnp.zeros((batch, cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim), jnp.float32),
    )


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype, with_mtp: bool = False,
               kv_dtype=None) -> ModelCache:
    """Zeroed cache for `batch` rows of up to `max_len` tokens, in `dtype` (float32 recurrent state aside).
    `kv_dtype`: the attention K and V's storage dtype instead (int8 or float8_e4m3fn: quantized, with scales;
    `kv_dtype_of` maps the names "int8" / "fp8"); None: `dtype`."""
    if kv_dtype is not None and not is_quantized(kv_dtype) and not jnp.issubdtype(kv_dtype, jnp.floating):
        raise ValueError(f"kv_dtype must be a float dtype, int8 or float8_e4m3fn, got {jnp.dtype(kv_dtype)}")
    s = cache_len_for(cfg, max_len)
    layers = []
    for i in range(cfg.num_layers):
        if cfg.layer_is_linear(i):
            mixer = _deltanet_cache(cfg, batch, dtype)
        else:
            mixer = _attention_cache(cfg, batch, s, dtype, kv_dtype)
        ple = None
        if i in cfg.ple_layers:
            width = cfg.hidden_size * max(cfg.hc_count, 1)
            ple = PleCache(conv=jnp.zeros((batch, width, cfg.ple_conv_state_len), dtype))
        layers.append(LayerCache(mixer=mixer, ple=ple))
    lengths = jnp.zeros((batch,), jnp.int32)
    if not with_mtp:
        return ModelCache(layers=tuple(layers), lengths=lengths)
    mtp = LayerCache(mixer=_attention_cache(cfg, batch, s, dtype, kv_dtype))
    return ModelCache(layers=tuple(layers), lengths=lengths, mtp=mtp, mtp_lengths=jnp.zeros((batch,), jnp.int32))


def cache_bytes(cache: ModelCache) -> int:
    """Total bytes held by a cache."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
