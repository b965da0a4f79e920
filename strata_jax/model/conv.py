"""Causal depthwise convolution with a carried tail, shared by Gated DeltaNet and PLE."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(
    x: jax.Array, state: jax.Array, weight: jax.Array, n_valid: jax.Array, dilation: int = 1
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv of x [B, T, C] continuing from `state` [B, C, L] (L = (kernel-1)*dilation).

    `weight` is [C, kernel] (torch's conv1d weight without its middle axis). Returns the conv output [B, T, C]
    (no activation) and the new state: the last L inputs among the first `n_valid[b]` tokens of each row,
    so padded tokens past `n_valid` never enter the state.
    """
    kernel = weight.shape[-1]
    tail = state.shape[-1]
    xs = jnp.concatenate([state, jnp.swapaxes(x, 1, 2).astype(state.dtype)], axis=-1)  # [B, C, L+T]
    t = x.shape[1]
    w = weight.astype(jnp.float32)
    out = jnp.zeros(x.shape[:1] + (weight.shape[0], t), jnp.float32)
    for k in range(kernel):
        start = k * dilation
        out = out + w[None, :, k : k + 1] * xs[:, :, start : start + t].astype(jnp.float32)
    return jnp.swapaxes(out, 1, 2).astype(x.dtype), _tail_after(xs, n_valid, tail)


def _tail_after(xs: jax.Array, n_valid: jax.Array, tail: int) -> jax.Array:
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, tail, axis=-1))(xs, n_valid)


def advance_tail(state: jax.Array, x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """The conv state [B, C, L] after feeding the first n_valid[b] rows of x [B, T, C] (no convolution)."""
    xs = jnp.concatenate([state, jnp.swapaxes(x, 1, 2).astype(state.dtype)], axis=-1)
    return _tail_after(xs, n_valid, state.shape[-1])
