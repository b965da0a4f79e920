"""What the per-call benchmark modes (hyper, deltanet, attention) share: the median timing of a jitted call, the
relative difference of a variant's output, and the table they print (one row per measured variant, its time
against the floor and against the jnp form at the same shape); and the bf16 matmul rate that the compute floors of
the prefill and kernel benchmarks divide by."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(f, inputs: tuple, steps: int) -> float:
    """Median seconds of `steps` runs of f(*inputs), each waited for (f compiled and warmed up already)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute difference over the largest magnitude of `want`."""
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def print_variant_table(rows: list[dict], keys: tuple[str, ...], time_key: str, unit: str, err_key: str,
                        err_label: str) -> None:
    """rows carry ``keys`` (the shape columns), "variant", ``time_key`` (us), "floor_us", "floor_fraction" and
    ``err_key``; "vs jnp" is the jnp row's time at the same ``keys`` over this row's."""
    base = {tuple(r[k] for k in keys): r[time_key] for r in rows if r["variant"] == "jnp"}
    cols = [*keys, "variant", unit, "floor us", "% floor", "vs jnp", err_label]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        ref = base.get(tuple(r[k] for k in keys))
        ratio = f"{ref / r[time_key]:.2f}x" if ref else "-"
        shape = "".join(f"{r[k]} | " for k in keys)
        print(f"| {shape}{r['variant']} | {r[time_key]:.1f} | {r['floor_us']:.1f} | {r['floor_fraction']:.0%} | "
              f"{ratio} | {r[err_key]:.1e} |")


def matmul_rate(n: int | None = None, reps: int = 10) -> float:
    """FLOP/s of a large bf16 matmul on the default device (the compute roof prefill is measured against); n
    defaults to 8192 on an accelerator and 1024 on a CPU (where 8192 would take minutes)."""
    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)
