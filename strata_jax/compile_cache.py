"""A persistent cache of compiled XLA programs, so that a restarted server loads its step functions instead of
compiling them again (a Flash-Next engine compiles 13 of them in ~250 s on the H200's host).

`serve` turns it on by default (`--compile-cache`); a key is the program and the compiler's version and options, so
a new jax, another device or other shapes compile afresh and a stale entry is never used.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The largest the cache grows to; jax evicts the least recently used entries past it.
MAX_BYTES = 8 * 2**30


def default_cache_dir() -> str:
    """`$JAX_COMPILATION_CACHE_DIR` when set (jax's own variable), else `$XDG_CACHE_HOME/strata_jax/xla` or
    `~/.cache/strata_jax/xla`."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "strata_jax" / "xla")


def enable_compile_cache(path: str | None) -> str | None:
    """Points jax's persistent compilation cache at `path` ("off" or None: leaves jax's settings alone); returns the
    directory used, or None. Programs that compile in under a second are not stored (jax's default threshold).
    A directory that cannot be created disables the cache with a message instead of failing the start."""
    if path is None or path == "off":
        return None
    import jax

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"compile cache off: cannot create {path}: {exc}", flush=True)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if "jax_compilation_cache_max_size" in jax.config.values:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
