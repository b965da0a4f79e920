"""The host expert pool of one loaded model: the worker threads, the kernel choice and the busy counters that its MoE
layers' host tiers (`strata_jax.host.tier.HostTier`) share. One object per model, no process-wide state."""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from typing import TYPE_CHECKING

import threadpoolctl

from strata_jax.host.cpu_quota import cpu_budget

if TYPE_CHECKING:
    from strata_jax.host.tier import HostTier

KERNELS = ("numba", "xla", "numpy")


def check_kernel(kernel: str) -> None:
    """Raises ValueError unless `kernel` is one of `KERNELS`."""
    if kernel not in KERNELS:
        raise ValueError(f"host kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")


def default_kernel() -> str:
    """The host kernel to use when none is asked for: "numba" where numba imports (`strata_jax.host.experts_numba`:
    1.3-2.2x less CPU per layer than "xla" on the dev machine, docs/PERF.md), else "xla". Imports numba (once) to
    find out."""
    from strata_jax.host.experts_numba import numba_available

    return "numba" if numba_available() else "xla"


class HostPool:
    """Threads, kernel and busy counters shared by one model's host tiers.

    kernel: "xla" (compiled by XLA:CPU, the default), "numba" (compiled by numba: one parallel call per layer on
    `workers` threads; `default_kernel` picks it where numba imports) or "numpy" (the reference), for tiers created
    afterwards; `use_kernel` switches the existing ones too. workers: threads (None: from the CPU quota granted,
    `strata_jax.host.cpu_quota.cpu_budget`, read when first needed). The threads start on first use (`executor`)."""

    def __init__(self, kernel: str = "xla", workers: int | None = None):
        check_kernel(kernel)
        if workers is not None and workers < 1:
            raise ValueError(f"pool workers must be >= 1, got {workers}")
        self._kernel = kernel
        self._workers = workers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._calls = 0
        self._seconds = 0.0
        # Weak: a tier lives as long as its model's graph, which the pool must not keep alive.
        self._tiers: weakref.WeakSet[HostTier] = weakref.WeakSet()

    @property
    def kernel(self) -> str:
        """The kernel tiers start with (the last `use_kernel`)."""
        return self._kernel

    @property
    def workers(self) -> int:
        """Threads of the pool: as given, else from the CPU quota granted."""
        with self._lock:
            return self._resolve_workers()

    def _resolve_workers(self) -> int:
        if self._workers is None:
            self._workers = cpu_budget().workers
        return self._workers

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The worker threads, started on first use. Starting them limits numpy's BLAS to one thread for the whole
        process: the pool already runs one expert per core, and BLAS threads on top of it (prefill's blocked path
        multiplies through BLAS) oversubscribe the cores and spin -- 2x slower on 2 cores, measured 2026-11-29."""
        with self._lock:
            if self._executor is None:
                threadpoolctl.threadpool_limits(limits=1, user_api="blas")
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._resolve_workers(), thread_name_prefix="strata-host-expert")
            return self._executor

    def add(self, tier: HostTier) -> None:
        """Registers a tier that computes on this pool (`use_kernel` switches it)."""
        with self._lock:
            self._tiers.add(tier)

    def use_kernel(self, kernel: str) -> None:
        """Switches every tier of the pool, and those created later, to `kernel` without reloading (benchmarks)."""
        check_kernel(kernel)
        with self._lock:
            self._kernel = kernel
            tiers = list(self._tiers)
        for tier in tiers:
            tier.use_kernel(kernel)

    def record(self, seconds: float) -> None:
        """Counts one host callback that took `seconds`."""
        with self._lock:
            self._calls += 1
            self._seconds += seconds

    def busy(self) -> tuple[int, float]:
        """(callbacks run, seconds spent inside them) since the pool was created, over all its tiers: the host's
        share of a step's time (benchmarks difference two readings)."""
        with self._lock:
            return self._calls, self._seconds
