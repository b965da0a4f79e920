"""One MoE layer's host tier: the packed bytes of all its experts in host memory, and the callback that computes
the pairs routed to experts outside the device pool on its model's `HostPool`, compiled by XLA:CPU
(`strata_jax.host.experts_xla`, the default), by numba (`strata_jax.host.experts_numba`, one parallel call per
layer) or in numpy (`strata_jax.host.experts_numpy`, their reference).
Implements the model's `strata_jax.model.moe.HostExperts`."""

from __future__ import annotations

import time
import warnings

import jax
import numpy as np

from pallas_kernels.onebit_format import PackedExperts, bytes_to_words, words_to_bytes
from strata_jax.host.experts_numba import NumbaStack, host_experts_numba, numba_available
from strata_jax.host.experts_numpy import NumpyStack, host_experts
from strata_jax.host.experts_xla import XlaStack, host_experts_xla
from strata_jax.host.pool import HostPool, check_kernel

_PROJECTIONS = ("gate_up", "down")


def _cpu_device():
    """XLA's CPU device, or None when this process has no CPU backend (JAX_PLATFORMS without "cpu")."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


class HostTier:
    """Holds one layer's experts in host memory (filled by the loader) and computes host pairs on `pool`.

    Bits are kept byte-major (the format's "bytes" layout), as XLA:CPU arrays when the "xla" kernel is selected (the
    numpy path reads the same memory through zero-copy views), else as numpy arrays. Hashed by identity: it is static
    data of the model's graph (one object per layer)."""

    _KINDS = ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")

    def __init__(self, group: int, pool: HostPool):
        self.group = group
        self.pool = pool
        self.kernel = pool.kernel
        if self.kernel == "numba" and not numba_available():
            warnings.warn("numba does not import: host experts fall back to the xla kernel", stacklevel=2)
            self.kernel = "xla"
        self._arrays: dict[str, np.ndarray | jax.Array] = {}
        self._stack: NumpyStack | XlaStack | NumbaStack | None = None
        pool.add(self)

    def set(self, name: str, array: np.ndarray) -> None:
        """Sets one of the four arrays of all E experts from the checkpoint's layout (bits: packed words)."""
        if name not in self._KINDS:
            raise KeyError(name)
        array = words_to_bytes(array) if name.endswith("_bits") else np.asarray(array)
        cpu = _cpu_device() if self.kernel == "xla" else None
        if self.kernel == "xla" and cpu is None:
            warnings.warn("no XLA CPU backend in this process (JAX_PLATFORMS?): host experts fall back to numpy",
                          stacklevel=2)
            self.kernel = "numpy"
        self._arrays[name] = jax.device_put(array, cpu) if cpu is not None else array
        self._stack = None

    def rows(self, name: str, experts: np.ndarray) -> np.ndarray:
        """Experts' rows of one array in the checkpoint's (and device pool's) layout: bits as packed words."""
        view = np.asarray(self._arrays[name])[experts]
        return bytes_to_words(view) if name.endswith("_bits") else view

    def use_kernel(self, kernel: str) -> None:
        """Switches this layer's implementation ("numba", "xla" or "numpy") without reloading (benchmarks)."""
        check_kernel(kernel)
        if kernel == "xla" and _cpu_device() is None:
            raise RuntimeError("the xla host kernel needs XLA's CPU backend (JAX_PLATFORMS without cpu)")
        if kernel == "numba" and not numba_available():
            raise RuntimeError("the numba host kernel needs numba (pip install numba)")
        self.kernel = kernel
        self._stack = None

    @property
    def loaded(self) -> bool:
        return all(k in self._arrays for k in self._KINDS)

    def _packed(self, kind: str, put) -> PackedExperts:
        return PackedExperts(put(self._arrays[f"{kind}_bits"]), put(self._arrays[f"{kind}_scales"]), self.group,
                             "bytes")

    @property
    def stack(self) -> NumpyStack | XlaStack | NumbaStack:
        """The layer's experts for the current kernel (built on first use after a change)."""
        if self._stack is None:
            if not self.loaded:
                raise RuntimeError("the host tier's experts were never loaded (a layer with host_path='stream' keeps "
                                   "them in pinned host memory and computes none on the host)")
            if self.kernel == "xla":
                cpu = _cpu_device()
                self._stack = XlaStack(*(self._packed(k, lambda a: jax.device_put(a, cpu)) for k in _PROJECTIONS))
            elif self.kernel == "numba":
                self._stack = NumbaStack(*(self._packed(k, np.asarray) for k in _PROJECTIONS))
            else:
                self._stack = NumpyStack(*(self._packed(k, np.asarray) for k in _PROJECTIONS))
        return self._stack

    def warm_up(self, max_rows: int) -> None:
        """Compiles the host kernels for up to `max_rows` rows per expert (every layer of a model shares them); a
        tier that holds nothing (its layer streams its experts instead) has nothing to compile."""
        if self.loaded and isinstance(self.stack, XlaStack):
            self.stack.warm_up(max_rows)
        elif self.loaded and isinstance(self.stack, NumbaStack):
            self.stack.warm_up(max_rows, threads=self.pool.workers)

    def compute(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The callback: sum over mask[t, j] of weights[t, j] * expert_ids[t, j](x[t]) -> [T, H] float32."""
        started = time.perf_counter()
        args = (self.stack, np.asarray(x, np.float32), np.asarray(ids), np.asarray(weights), np.asarray(mask, bool))
        if self.kernel == "numba":  # numba runs its own threads, as many as the pool has workers
            out = host_experts_numba(*args, threads=self.pool.workers)
        else:
            out = (host_experts_xla if self.kernel == "xla" else host_experts)(*args, self.pool.executor)
        self.pool.record(time.perf_counter() - started)
        return out
