"""Basic building blocks: linear projections in HF weight layout, the RMSNorm variants and partial RoPE.

Parameters keep the Hugging Face names and layouts (`weight` of shape [out, in]) so that a checkpoint tensor's
name is its path in the module tree; nothing is transposed at load time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.activations import silu
from strata_jax.model.params import empty_param


class Linear(nnx.Module):
    """y = x @ weight.T without bias; `weight` is [out_features, in_features] as in torch."""

    def __init__(self, in_features: int, out_features: int, dtype: jnp.dtype):
        self.weight = empty_param((out_features, in_features), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in float32.

    With `group_size`, the last axis is normalised in independent groups (one per hyper-connection stream).
    """

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, group_size: int | None = None):
        self.weight = empty_param((dim,), dtype)
        self.eps = eps
        self.group_size = group_size

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        if self.group_size is not None:
            xf = xf.reshape(*xf.shape[:-1], -1, self.group_size)
        out = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.group_size is not None:
            out = out.reshape(*out.shape[:-2], -1)
        return (out * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: plain-weight RMSNorm, then times act(gate) (SiLU or sigmoid)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, activation: str):
        self.weight = empty_param((dim,), dtype)
        self.eps = eps
        self.activation = activation

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        out = self.weight[...] * xf.astype(x.dtype)
        g = gate.astype(jnp.float32)
        g = silu(g) if self.activation == "silu" else jax.nn.sigmoid(g)
        return (out.astype(jnp.float32) * g).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., rotary_dim] for integer positions, in the rotate-half layout (frequencies repeated)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first `rotary_dim` features of x [..., heads, dim]; cos/sin are [..., rotary_dim]."""
    rot = cos.shape[-1]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(self, vocab: int, dim: int, dtype: jnp.dtype):
        self.weight = empty_param((vocab, dim), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class MLP(nnx.Module):
    """SiLU-gated MLP (the shared expert, and qwen3_next's dense layers)."""

    def __init__(self, hidden: int, intermediate: int, dtype: jnp.dtype):
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DepthwiseConvWeight(nnx.Module):
    """Holds a depthwise conv1d weight in torch layout [channels, 1, kernel]."""

    def __init__(self, channels: int, kernel: int, dtype: jnp.dtype):
        self.weight = empty_param((channels, 1, kernel), dtype)

    def kernel(self) -> jax.Array:
        """The weight as [channels, kernel]."""
        return self.weight[...][:, 0, :]
