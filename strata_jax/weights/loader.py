"""Filling a model's parameters from a HF checkpoint: name mapping, expert fusion, shape checks, PLE tables.

Our module tree uses the HF names, so mapping is mostly a prefix: `model.*` lives under `model.` (causal LM) or
`model.language_model.` (the multimodal wrapper, whose vision tower is skipped). Routed experts arrive fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) or per expert (Qwen3-Next's original
`mlp.experts.{e}.{gate,up,down}_proj.weight`); both become the fused layout. PLE tables (`...ngram_embedding.weight`
or its `shard_{i}` parts) stay host-side as memory maps.
"""

from __future__ import annotations

import re
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.model.config import ModelConfig
from strata_jax.model.moe import QuantizedExperts
from strata_jax.model.ple_hash import PleTable
from strata_jax.weights.onebit import quantize_experts
from strata_jax.weights.safetensors_io import CheckpointError, CheckpointReader

_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def has_mtp(reader: CheckpointReader) -> bool:
    """Whether the checkpoint carries an MTP module."""
    return any(n.startswith("mtp.") for n in reader.names())


def hf_name(cfg: ModelConfig, ours: str) -> str:
    """Checkpoint name of one of our parameter paths."""
    if ours.startswith("model."):
        return cfg.weight_prefix + ours[len("model.") :]
    return ours


def _read_expert(reader: CheckpointReader, name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    if name in reader:
        arr = reader.get(name)
        if arr.shape != shape and arr.shape == (shape[0], shape[2], shape[1]):
            arr = np.swapaxes(arr, 1, 2)  # older fused layout [E, in, out]
        return arr
    base = name[: -len(kind) - 1]
    n_experts = shape[0]
    parts = []
    for e in range(n_experts):
        if kind == "gate_up_proj":
            gate, up = reader.get(f"{base}.{e}.gate_proj.weight"), reader.get(f"{base}.{e}.up_proj.weight")
            parts.append(np.concatenate([gate, up], axis=0))
        else:
            parts.append(reader.get(f"{base}.{e}.down_proj.weight"))
    return np.stack(parts)


def _read(reader: CheckpointReader, cfg: ModelConfig, ours: str, shape: tuple[int, ...]) -> np.ndarray:
    name = hf_name(cfg, ours)
    m = _EXPERT.match(name)
    arr = _read_expert(reader, name, m["kind"], shape) if m else reader.get(name)
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr


def fill_params(model: nnx.Module, cfg: ModelConfig, reader: CheckpointReader, dtype: jnp.dtype) -> None:
    """Replaces every (abstract) parameter of `model` with the checkpoint's tensor, converted to `dtype`.

    Packed expert modules are filled by quantizing the checkpoint's dense experts (one layer at a time)."""
    packed = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, QuantizedExperts)}
    params = [
        (path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param) and path[:-1] not in packed
    ]
    total = len(params) + len(packed)
    progress = _Progress("loading weights", total)
    for path, param in params:
        ours = ".".join(str(p) for p in path)
        arr = _read(reader, cfg, ours, tuple(param.shape))
        param.set_value(jnp.asarray(arr.astype(np.dtype(dtype), copy=False)))
        progress.step()
    for path, module in packed.items():
        base = ".".join(str(p) for p in path)
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        q = module.quant
        for kind, shape in (("gate_up", (e, 2 * i, h)), ("down", (e, h, i))):
            dense = _read(reader, cfg, f"{base}.{kind}_proj", shape)
            pk = quantize_experts(dense.astype(np.float32), group=q.group, planes=q.planes)
            module.load(kind, pk.bits, pk.scales)
        progress.step()
    progress.done()


class _Progress:
    """A one-line progress display on an interactive stderr."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.count = what, total, 0
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self) -> None:
        self.count += 1
        if self.tty and (self.count % 20 == 0 or self.count == self.total):
            elapsed = time.monotonic() - self.started
            print(f"\r{self.what} {self.count}/{self.total} ({elapsed:.1f}s)", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def load_ple_tables(cfg: ModelConfig, reader: CheckpointReader) -> list[PleTable]:
    """Host-side PLE tables, one per PLE layer, in `cfg.ple_layers` order."""
    tables = []
    for layer in cfg.ple_layers:
        base = f"{cfg.weight_prefix}layers.{layer}.ple.ple_embedding.ngram_embedding"
        if f"{base}.weight" in reader:
            shards = [reader.memmap(f"{base}.weight")]
        else:
            names = [n for n in reader.names() if n.startswith(f"{base}.shard_") and n.endswith(".weight")]
            if not names:
                raise CheckpointError(f"tensor {base}.weight (or its shard_* parts) not found")
            names.sort(key=lambda n: int(n[len(base) + len(".shard_") : -len(".weight")]))
            shards = [reader.memmap(n) for n in names]
        tables.append(PleTable(shards))
    return tables
