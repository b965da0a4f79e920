"""One MoE layer's host tier: the packed bytes of all its experts in host memory, and the callback that computes
the pairs routed to experts outside the device pool on a shared thread pool, compiled by XLA:CPU
(`strata_jax.host.experts_xla`, the default) or in numpy (`strata_jax.host.experts_numpy`, its reference).

The pool is sized from the CPU budget actually granted (`strata_jax.host.cpu_quota.cpu_budget`) unless
`configure_workers` set it first (`--pool-workers`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings

import jax
import numpy as np
import threadpoolctl

from strata_jax.host.experts_numpy import PackedStack, host_experts
from strata_jax.host.experts_xla import XlaStack, bytes_to_words, host_experts_xla, words_to_bytes

KERNELS = ("xla", "numpy")

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_WORKERS: int | None = None
_LOCK = threading.Lock()
_KERNEL = "xla"
_BUSY = {"calls": 0, "seconds": 0.0}  # every layer's callbacks together (`busy`)


def configure_workers(workers: int | None) -> None:
    """Sets the host pool size (None: from the CPU quota); takes effect for a pool not created yet."""
    global _WORKERS
    if workers is not None and workers < 1:
        raise ValueError(f"pool workers must be >= 1, got {workers}")
    _WORKERS = workers


def worker_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide host expert pool (created on first use). Creating it limits numpy's BLAS to one thread for
    the whole process: the pool already runs one expert per core, and BLAS threads on top of it (prefill's blocked
    path multiplies through BLAS) oversubscribe the cores and spin -- 2x slower on 2 cores, measured 2026-11-29."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            threadpoolctl.threadpool_limits(limits=1, user_api="blas")
            workers = _WORKERS
            if workers is None:
                from strata_jax.host.cpu_quota import cpu_budget

                workers = cpu_budget().workers
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="strata-host-expert")
        return _POOL


def busy() -> tuple[int, float]:
    """(callbacks run, seconds spent inside them) since the process started, over every layer's host tier: the
    host's share of a step's time (benchmarks difference two readings)."""
    with _LOCK:
        return _BUSY["calls"], _BUSY["seconds"]


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"host kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")


def configure_kernel(kernel: str) -> None:
    """Selects the host experts' implementation: "xla" (compiled by XLA:CPU, the default) or "numpy" (the reference).
    Takes effect for layers loaded afterwards."""
    global _KERNEL
    _check_kernel(kernel)
    _KERNEL = kernel


def _cpu_device():
    """XLA's CPU device, or None when this process has no CPU backend (JAX_PLATFORMS without "cpu")."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


class HostTier:
    """Holds one layer's experts in host memory (filled by the loader) and computes host pairs.

    Bits are kept byte-major (`words_to_bytes`), as XLA:CPU arrays when the "xla" kernel is selected (the numpy
    path reads the same memory through zero-copy views), else as numpy arrays. Hashed by identity: it is static
    data of the model's graph (one object per layer)."""

    _KINDS = ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")

    def __init__(self, group: int):
        self.group = group
        self.kernel = _KERNEL
        self._arrays: dict[str, np.ndarray | jax.Array] = {}
        self._stack: PackedStack | XlaStack | None = None

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
        """Switches this layer's implementation (`configure_kernel`'s choices) without reloading (benchmarks)."""
        _check_kernel(kernel)
        if kernel == "xla" and _cpu_device() is None:
            raise RuntimeError("the xla host kernel needs XLA's CPU backend (JAX_PLATFORMS without cpu)")
        self.kernel = kernel
        self._stack = None

    @property
    def loaded(self) -> bool:
        return all(k in self._arrays for k in self._KINDS)

    @property
    def stack(self) -> PackedStack | XlaStack:
        if self._stack is None:
            if not self.loaded:
                raise RuntimeError("the host tier's experts were never loaded")
            if self.kernel == "xla":
                cpu = _cpu_device()
                self._stack = XlaStack(*(jax.device_put(self._arrays[k], cpu) for k in self._KINDS), group=self.group)
            else:
                self._stack = PackedStack(*(np.asarray(self._arrays[k]) for k in self._KINDS), group=self.group)
        return self._stack

    def warm_up(self, max_rows: int) -> None:
        """Compiles the host kernels for up to `max_rows` rows per expert (every layer of a model shares them)."""
        if isinstance(self.stack, XlaStack):
            self.stack.warm_up(max_rows)

    def compute(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The callback: sum over mask[t, j] of weights[t, j] * expert_ids[t, j](x[t]) -> [T, H] float32."""
        run = host_experts_xla if self.kernel == "xla" else host_experts
        started = time.perf_counter()
        out = run(self.stack, np.asarray(x, np.float32), np.asarray(ids), np.asarray(weights),
                  np.asarray(mask, bool), worker_pool())
        with _LOCK:
            _BUSY["calls"] += 1
            _BUSY["seconds"] += time.perf_counter() - started
        return out
