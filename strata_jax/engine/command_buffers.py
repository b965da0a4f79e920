"""How XLA keeps the decode step's CUDA graphs: one flag, chosen before JAX starts its GPU backend.

XLA runs a compiled step as CUDA graphs ("command buffers") whose nodes hold device addresses. When a buffer the
step uses lands at another address than at the last call, XLA updates the graph before launching it. The step's
scratch memory is one allocation that every node touches, so when it moves, all ~1,900 nodes of the Flash-Next
decode step are updated (10-11 ms of host time on the H200) and the graph is uploaded again (~9 ms): the host, not
the device, then sets the rate. In the engine it moves from step to step because outputs still in use by the
device are freed later, at moments that vary (docs/PERF.md, "Engine decode step").

XLA's `--xla_gpu_command_buffer_update_mode=SKIP_TEMP` (jax 0.11) maps the scratch memory at a fixed virtual
address (XLA's VMM allocator), so the graphs are not updated for it. Measured on the H200 (2026-12-03): one user
76.4 -> 152.1 tok/s, the same tokens. The flag turns on XLA's VMM allocator, under which a direct `device_put`
into pinned host memory crashes the process (segfault, 2026-12-04); streamed experts' rows are therefore moved there
by a jitted copy under it (`expert_stream.to_host_memory`), which a probe found exact. The streamed step itself
has not been timed under the flag, so "auto" keeps XLA's default for a plan with experts outside the device pool
(streamed, or computed by the host), and `--command-buffers stable-scratch` runs it when asked.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

FLAG = "--xla_gpu_command_buffer_update_mode"
MODES = ("auto", "stable-scratch", "xla")
_XLA_VALUE = {"stable-scratch": "SKIP_TEMP"}


def supports_stable_scratch(jax_version: str | None = None) -> bool:
    """Whether this jaxlib takes the flag's SKIP_TEMP: 0.11 does; 0.10 aborts at start-up on the unknown flag, and
    upstream XLA has since renamed the values (a jaxlib after 0.11 is not assumed to take them until measured)."""
    if jax_version is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            jax_version = version("jaxlib")
        except PackageNotFoundError:
            return False
    parts = []
    for piece in jax_version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return (0, 11) <= tuple(parts) < (0, 12)


def choose_mode(mode: str, backend: str | None, host_tier: bool, environ: MutableMapping[str, str],
                jax_version: str | None = None) -> tuple[str, str]:
    """(mode, why): "stable-scratch" or "xla" for a requested `mode` ("auto" picks). `backend` is the device
    probe's ("gpu", "cpu", None when unknown); `host_tier`: the plan leaves experts outside the device pool
    (streamed from pinned host memory, or computed by the host): "auto" then keeps XLA's default. Raises ValueError
    for "stable-scratch" where the jaxlib cannot take it."""
    if mode not in MODES:
        raise ValueError(f"command buffer mode {mode!r}: expected one of {', '.join(MODES)}")
    if FLAG in environ.get("XLA_FLAGS", ""):
        return "xla", f"XLA_FLAGS already sets {FLAG}"
    if mode == "xla":
        return "xla", "asked for (--command-buffers xla)"
    if not supports_stable_scratch(jax_version):
        problem = "only jax 0.11's XLA is known to take it: 0.10 has no such flag, later ones renamed its values"
        if mode == "stable-scratch":
            raise ValueError(f"--command-buffers stable-scratch: {problem}")
        return "xla", problem
    if mode == "stable-scratch":
        if host_tier:
            return mode, ("asked for (--command-buffers stable-scratch); with experts outside the device pool it is "
                          "not yet measured (docs/PERF.md)")
        return mode, "asked for (--command-buffers stable-scratch)"
    if host_tier:
        return "xla", ("experts outside the device pool: not yet measured under stable-scratch (--command-buffers "
                       "stable-scratch runs it)")
    if backend not in ("gpu", "cuda"):
        return "xla", f"no CUDA graphs on the {backend} backend" if backend else "no GPU backend found"
    return "stable-scratch", "the decode step's CUDA graphs are then not updated every step"


def installed_backend(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """The backend JAX will start, guessed without starting it (for a process without a device probe): "cpu" when
    JAX_PLATFORMS says so, "gpu" when a jax CUDA plugin is installed, else None."""
    from importlib.metadata import distributions

    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and "cuda" not in platforms and "gpu" not in platforms:
        return platforms.split(",")[0]
    names = ((d.metadata.get("Name") or "").lower().replace("_", "-") for d in distributions())
    return "gpu" if any(name.startswith("jax-cuda") for name in names) else None


def apply_mode(mode: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds the flag for `mode` to XLA_FLAGS (nothing for "xla"); effective only before JAX's backend starts."""
    value = _XLA_VALUE.get(mode)
    if value is not None:
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {FLAG}={value}".strip()


def configure(mode: str, backend: str | None, host_tier: bool,
              environ: MutableMapping[str, str] = os.environ) -> str:
    """`choose_mode` then `apply_mode`; returns a line for the start-up log."""
    chosen, why = choose_mode(mode, backend, host_tier, environ)
    apply_mode(chosen, environ)
    return f"command buffers: {chosen} ({why})"
