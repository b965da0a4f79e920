"""Floors of a decode step: the bytes it must move (over the copy bandwidth measured on the device) and the kernels
it launches (x the ~5 us each measured on the H200)."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.engine.planner import device_memory
from strata_jax.model.config import ModelConfig
from strata_jax.model.moe import QuantizedExperts

LAUNCH_US = 5.0  # measured per-kernel cost of a small step on the H200 (docs/ARCHITECTURE.md, "Background")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Instructions that launch nothing: they name, reshape or forward buffers.
_FREE_OPS = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier"})
# Instructions whose callees run as part of them (a fusion's computation is one kernel, not its instructions).
_CONTROL_OPS = frozenset({"while", "conditional", "call"})


PROBE_GIB = 2.0  # the largest bandwidth probe: far past every cache
MIN_PROBE_GIB = 1 / 16


def free_memory_bytes(device=None) -> int | None:
    """Memory free where arrays of `device` (default: the first) live: the device allocator's limit less its use,
    or, for a CPU, the host's available memory (/proc/meminfo) capped by the cgroup's memory limit less its usage;
    None when unknown."""
    on_device = device_memory(device)
    if on_device is not None:
        return on_device.free
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a page-rounded 2^63 mean no limit
            candidates.append(max(0, int(limit) - usage))
    return min(candidates) if candidates else None


def probe_gib(limit: float = PROBE_GIB, device=None) -> float:
    """A bandwidth probe's size for this machine: `limit` GiB, or an eighth of the free memory if that is less
    (the probe holds its input, its output and the generator's temporaries), and at least MIN_PROBE_GIB."""
    free = free_memory_bytes(device)
    if free is None:
        return limit
    return max(MIN_PROBE_GIB, min(limit, free / 8 / 2**30))


def copy_bandwidth(gib: float | None = None, reps: int = 20) -> float:
    """Bytes/s of one fused elementwise pass (read + write) over a large random bf16 array of `gib` GiB (default:
    `probe_gib()`, sized to the free memory)."""
    gib = probe_gib() if gib is None else gib
    n = int(gib * 2**30 / 2)
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.0001 + 0.5)
    return 2 * n * 2 / _median_seconds(f, x, reps)


def _median_seconds(f, x, reps: int) -> float:
    """Median wall time of `f(x)` over `reps` runs after one warm-up run."""
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def memory_bandwidth(gib: float | None = None, reps: int = 7) -> tuple[float, float]:
    """(copy, read) bytes/s of the first device over a random uint32 array of `gib` GiB (default: `probe_gib(1)`):
    an XOR pass that reads and writes it, and an XOR reduction that only reads it. Integer work, so a CPU is
    measured at its memory rate rather than at its bf16 arithmetic."""
    gib = probe_gib(1.0) if gib is None else gib
    n = max(1024, int(gib * 2**30 / 4) // 1024 * 1024)
    a = jax.random.bits(jax.random.key(1), (n,), jnp.uint32)
    copy = jax.jit(lambda x: x ^ jnp.uint32(0x5A5A5A5A))
    read = jax.jit(lambda x: jnp.bitwise_xor.reduce(x.reshape(-1, 1024), axis=1))
    return 2 * n * 4 / _median_seconds(copy, a, reps), n * 4 / _median_seconds(read, a, reps)


def _computations(hlo_text: str) -> tuple[str | None, dict[str, list[str]]]:
    """(the entry computation's name, every computation's instruction lines) of an HLO module's text."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line[:1].isspace():  # headers start in column 0, instructions are indented
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    return entry, computations


def _launching_ops(hlo_text: str, graphs_as_one: bool) -> dict[str, int]:
    """Kernel-launching instructions per execution by opcode (see `kernel_ops`); with `graphs_as_one`, a call of
    one of XLA's command buffers (a CUDA graph, launched by the host as one) counts once, as "command-buffer"."""
    entry, computations = _computations(hlo_text)
    counts: dict[str, int] = {}
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name not in computations:
            return
        seen.add(name)
        for line in computations[name]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(1) in _FREE_OPS or m.group(1).endswith("-done"):  # an async pair is one kernel
                continue
            op = m.group(1)
            if op in _CONTROL_OPS:
                callees = re.findall(r"(?:body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)", line)
                for callee in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    callees += [c.strip().lstrip("%") for c in callee.split(",")]
                if graphs_as_one and op == "call" and any(c.startswith("command_buffer") for c in callees):
                    counts["command-buffer"] = counts.get("command-buffer", 0) + 1
                    continue
                for callee in callees:
                    visit(callee)
                continue
            counts[op] = counts.get(op, 0) + 1

    if entry is not None:
        visit(entry)
    return counts


def kernel_ops(hlo_text: str) -> dict[str, int]:
    """Kernels a compiled (optimised) HLO module launches per execution, by opcode: every instruction of the entry
    computation that is not free (fusion, custom-call, copy, ...), with the bodies of loops and calls counted once
    (a loop body runs many times; this counts its kernels once). Instructions inside fused computations are not
    kernels and are not counted."""
    return _launching_ops(hlo_text, graphs_as_one=False)


def host_launches(hlo_text: str) -> tuple[int, int]:
    """(command buffers, launches the host makes per execution) of a compiled GPU module: kernels outside XLA's
    command buffers count one each, each command buffer (a CUDA graph of many kernels) counts one. A step whose
    kernels fall out of its graphs pays a host launch for each of them."""
    ops = _launching_ops(hlo_text, graphs_as_one=True)
    return ops.get("command-buffer", 0), sum(ops.values())


def count_kernels(hlo_text: str) -> int:
    """Kernel-launching instructions in a compiled module (fusions, custom calls, library calls, loops)."""
    return sum(kernel_ops(hlo_text).values())


def step_bytes(cfg: ModelConfig, model, slots: int, fill: int, tokens_per_slot: int = 1,
               kv_quantized: bool = False) -> dict[str, float]:
    """The fewest bytes one step must read (and write, for recurrent state) when it feeds `tokens_per_slot` tokens
    to each of `slots` slots (1: decode; k+1: a verify window). `kv_quantized`: K and V in one byte (int8 / fp8)
    with a float32 scale per position and kv head."""
    dense = experts_per_layer = expert_layers = 0
    for path, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedExperts):
            expert_layers += 1
            experts_per_layer = sum(
                getattr(node, n)[...].nbytes for n in ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")
            )
        elif isinstance(node, nnx.Param) and "experts" not in str(path) and "embed_tokens" not in str(path):
            dense += node[...].nbytes
    per_expert = experts_per_layer / cfg.num_experts
    distinct = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** (slots * tokens_per_slot))
    n_attn = cfg.layer_types.count("full_attention")
    n_lin = cfg.num_layers - n_attn
    kv_value = 2 * cfg.num_kv_heads * (cfg.head_dim + 4 if kv_quantized else cfg.head_dim * 2)  # K and V
    kv_tok = kv_value + (cfg.indexer_head_dim * 2 if cfg.qsa else 0)
    state = cfg.linear_num_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4
    return {
        "dense": dense,
        "experts": expert_layers * distinct * per_expert,
        "kv": n_attn * slots * fill * kv_tok,
        "recurrent": 2 * n_lin * slots * state,
        "embed": slots * tokens_per_slot * cfg.hidden_size * 2,
    }
