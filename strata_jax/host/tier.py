"""One MoE layer's host tier: the packed bytes of all its experts in host memory, and the callback that computes
the pairs routed to experts outside the device pool (`strata_jax.host.experts_numpy`) on a shared thread pool.

The pool is sized from the CPU budget actually granted (`strata_jax.engine.cpu_quota.cpu_budget`) unless
`configure_workers` set it first (`--pool-workers`)."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import threadpoolctl

from strata_jax.host.experts_numpy import PackedStack, host_experts

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_WORKERS: int | None = None
_LOCK = threading.Lock()


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
                from strata_jax.engine.cpu_quota import cpu_budget

                workers = cpu_budget().workers
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="strata-host-expert")
        return _POOL


class HostTier:
    """Holds one layer's experts as host numpy arrays (filled by the loader) and computes host pairs.

    Hashed by identity: it is static data of the model's graph (one object per layer)."""

    _KINDS = ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")

    def __init__(self, group: int):
        self.group = group
        self._arrays: dict[str, np.ndarray] = {}
        self._stack: PackedStack | None = None

    def set(self, name: str, array: np.ndarray) -> None:
        if name not in self._KINDS:
            raise KeyError(name)
        self._arrays[name] = array
        self._stack = None

    def get(self, name: str) -> np.ndarray:
        return self._arrays[name]

    @property
    def loaded(self) -> bool:
        return all(k in self._arrays for k in self._KINDS)

    @property
    def stack(self) -> PackedStack:
        if self._stack is None:
            if not self.loaded:
                raise RuntimeError("the host tier's experts were never loaded")
            self._stack = PackedStack(*(self._arrays[k] for k in self._KINDS), group=self.group)
        return self._stack

    def compute(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The callback: sum over mask[t, j] of weights[t, j] * expert_ids[t, j](x[t]) -> [T, H] float32."""
        return host_experts(self.stack, np.asarray(x, np.float32), np.asarray(ids), np.asarray(weights),
                            np.asarray(mask, bool), worker_pool())
