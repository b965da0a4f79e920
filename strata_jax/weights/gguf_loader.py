"""Filling a model from a GGUF file: which expert format to use, one tensor at a time, and a report of what was exact.

`plan_experts` decides, from the expert tensors' types, whether routed experts are packed sign planes (and in how
many planes / which group) or dense; `fill_params_from_gguf` then fills every parameter (dense tensors dequantized to
the run dtype; sign-plane experts copied bit for bit; other low-bit experts dequantized and re-packed, each with its
relative error) and returns a `GGUFReport`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.onebit_format import PackedExperts
from strata_jax.model.config import ExpertQuantization, ModelConfig
from strata_jax.model.moe import QuantizedExperts
from strata_jax.model.ple_hash import NgramHasher, PleTable
from strata_jax.weights.gguf_config import PleHash, config_from_gguf, mtp_layers, ple_hash
from strata_jax.weights.gguf_convert import (
    REPACK_PLANES,
    check_expert_shapes,
    concat_outputs,
    exact_planes,
    expert_tensors,
    lift,
    native_planes,
    read_dense,
    relative_error,
    scale_rounding_error,
)
from strata_jax.weights.gguf_reader import GGUFError, GGUFFile, TensorInfo, dequantize_tensor
from strata_jax.weights.onebit import dequantize_experts, quantize_experts


@dataclass
class GGUFReport:
    """What loading a GGUF did: expert format, tensors mapped exactly, tensors re-packed (with their relative error),
    and what the file does not hold."""

    expert_format: str = ""
    exact: list[str] = field(default_factory=list)
    repacked: dict[str, float] = field(default_factory=dict)
    scale_rounding: dict[str, float] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    types: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"experts: {self.expert_format}"]
        types = ", ".join(f"{k} x{v}" for k, v in sorted(self.types.items()))
        out.append(f"tensor types: {types}")
        if self.exact:
            worst = max(self.scale_rounding.values(), default=0.0)
            out.append(f"{len(self.exact)} expert tensors mapped bit for bit (fp16 -> bf16 scale rounding: relative "
                       f"error <= {worst:.2e})")
        for name, err in self.repacked.items():
            out.append(f"re-packed {name}: relative error {err:.4f}")
        out += [f"not in the file: {m}" for m in self.missing]
        return out


def plan_experts(g: GGUFFile, cfg: ModelConfig, quantize: str | None, planes: int, group: int,
                 gpu_experts: int | None, **options) -> ExpertQuantization | None:
    """The expert format to load into: None (dense experts) or packed planes.

    quantize="1bit" forces packed experts in (`planes`, `group`). Otherwise the file decides: experts in sign-plane
    types (Q1_0, TQ1_0, TQ2_0) load packed in the fewest planes and the coarsest group that hold every tensor
    exactly; other <= 2-bit types are re-packed into 2 planes; anything wider (Q4_K, Q8_0, BF16, ...) stays dense.
    """
    tensors = [t for i in range(cfg.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in g
               for t in expert_tensors(g, i).all]
    if quantize == "1bit":
        return ExpertQuantization(planes=planes, group=group, gpu_experts=gpu_experts, **options)
    natives = [native_planes(t) for t in tensors]
    low_bit = [t for t, n in zip(tensors, natives) if n is None and t.type in REPACK_PLANES]
    if not tensors or (all(n is None for n in natives) and not low_bit):
        if gpu_experts is not None:
            raise ValueError("gpu_experts needs packed experts: this GGUF's experts are not in a 1-2 bit type "
                             "(pass quantize='1bit' to pack them)")
        return None
    if any(n is None and t.type not in REPACK_PLANES for t, n in zip(tensors, natives)):
        bad = next(t for t, n in zip(tensors, natives) if n is None and t.type not in REPACK_PLANES)
        # a mix of low-bit and wide experts: pack all (the wide ones quantized by our quantizer)
        print(f"gguf: {bad.name} ({bad.type_name}) is not a 1-2 bit type; quantizing it into packed planes",
              file=sys.stderr)
    want_planes = max([n[0] for n in natives if n] + [REPACK_PLANES[t.type] for t in low_bit] + [1])
    want_group = min([n[1] for n in natives if n] + ([128] if low_bit else []))
    return ExpertQuantization(planes=want_planes, group=want_group, gpu_experts=gpu_experts, **options)


def _packed_layer(g: GGUFFile, name: str, parts: tuple[TensorInfo, ...], q: ExpertQuantization,
                  report: GGUFReport) -> PackedExperts:
    out = []
    for t in parts:
        native = native_planes(t)
        if native and native[0] <= q.planes and native[1] % q.group == 0:
            p = exact_planes(t)
            report.exact.append(t.name)
            report.scale_rounding[t.name] = scale_rounding_error(t, p)
            out.append(lift(p, q.planes, q.group))
        else:
            w = dequantize_tensor(t)
            p = quantize_experts(w, group=q.group, planes=q.planes)
            err = relative_error(w, dequantize_experts(p))
            report.repacked[f"{t.name} ({t.type_name})"] = err
            print(f"gguf: re-packed {t.name} ({t.type_name}) into {q.planes} plane(s), group {q.group}: relative "
                  f"error {err:.4f}", file=sys.stderr)
            out.append(p)
    return concat_outputs(out)


def _dense_experts(parts: tuple[TensorInfo, ...]) -> np.ndarray:
    if len(parts) == 1:
        return dequantize_tensor(parts[0])
    return np.concatenate([dequantize_tensor(t) for t in parts], axis=1)


def fill_params_from_gguf(model: nnx.Module, cfg: ModelConfig, g: GGUFFile, dtype) -> GGUFReport:
    """Replaces every (abstract) parameter of `model` with the GGUF's tensor; returns what was exact and what not."""
    report = GGUFReport()
    for t in g.names():
        name = g.info(t).type_name
        report.types[name] = report.types.get(name, 0) + 1
    packed = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, QuantizedExperts)}
    params = [(path, node) for path, node in nnx.iter_graph(model)
              if isinstance(node, nnx.Param) and path[:-1] not in packed]
    total = len(params) + len(packed)
    progress = _Progress(total)
    np_dtype = np.dtype(dtype)
    for path, param in params:
        ours = ".".join(str(p) for p in path)
        if ours.endswith("mlp.experts.gate_up_proj") or ours.endswith("mlp.experts.down_proj"):
            layer = _layer_of(path)
            ex = expert_tensors(g, layer)
            check_expert_shapes(g, cfg, layer, ex)
            arr = _dense_experts(ex.gate_up) if ours.endswith("gate_up_proj") else dequantize_tensor(ex.down)
        else:
            arr = read_dense(g, cfg, ours, tuple(param.shape))
        param.set_value(jnp.asarray(arr.astype(np_dtype, copy=False)))
        progress.step()
    for path, module in packed.items():
        layer = _layer_of(path)
        ex = expert_tensors(g, layer)
        check_expert_shapes(g, cfg, layer, ex)
        q = module.quant
        for kind, parts in (("gate_up", ex.gate_up), ("down", (ex.down,))):
            pk = _packed_layer(g, kind, parts, q, report)
            module.load(kind, pk.bits, pk.scales)
        progress.step()
    progress.done()
    if packed:
        q = next(iter(packed.values())).quant
        how = "bit for bit" if not report.repacked else "partly re-packed"
        report.expert_format = f"packed, {q.planes} plane(s), group {q.group} ({how})"
    else:
        report.expert_format = "dense (dequantized to the run dtype)"
    report.missing += missing_parts(g, cfg)
    return report


def _layer_of(path: tuple) -> int:
    for a, b in zip(path, path[1:]):
        if a == "layers":
            return int(b)
    raise GGUFError(f"parameter {'.'.join(map(str, path))} is not in a layer")


def missing_parts(g: GGUFFile, cfg: ModelConfig) -> list[str]:
    """What the checkpoint format has and llama.cpp does not store (or we do not load from it)."""
    out = ["MTP head (llama.cpp stores none for this architecture): running without the MTP drafter"]
    if mtp_layers(g):
        out[0] = (f"MTP head: the file has {mtp_layers(g)} nextn layer(s), which strata_jax does not load from GGUF: "
                  "running without the MTP drafter")
    return out


def load_ple_tables_gguf(g: GGUFFile, cfg: ModelConfig) -> list[PleTable]:
    """The PLE table of the (single) PLE layer: memory-mapped when stored as F32, else dequantized once."""
    if not cfg.ple_layers:
        return []
    if len(cfg.ple_layers) > 1:
        raise GGUFError(f"{g.path}: {len(cfg.ple_layers)} PLE layers; llama.cpp's format holds one table")
    t = g.info("per_layer_token_embd.weight")
    arr = t.raw if t.type.name == "F32" else dequantize_tensor(t)
    return [PleTable([np.asarray(arr).reshape(t.shape)])]


def ple_hashers(h: PleHash | None, cfg: ModelConfig, tables: list[PleTable]) -> list[NgramHasher] | None:
    """Hashers built from the constants stored in the file (not re-derived from a seed)."""
    if h is None:
        return None
    heads = cfg.ple_ngram_heads
    if len(h.multipliers) < cfg.ngram_size or len(h.head_offsets) < heads or len(h.head_vocab_sizes) < heads:
        raise GGUFError("PLE hash constants are shorter than ngram_size / the number of heads")
    return [NgramHasher(
        multipliers=np.array(h.multipliers[: cfg.ngram_size], dtype=np.uint64).astype(np.int64),
        head_sizes=np.array(h.head_vocab_sizes[:heads], dtype=np.int64),
        head_offsets=np.array(h.head_offsets[:heads], dtype=np.int64),
        ngram_size=cfg.ngram_size,
        heads_per_ngram=cfg.heads_per_ngram,
        eos_id=h.eos_token_id,
        table_rows=tables[0].rows,
    )]


class _Progress:
    """Progress over the parameters on an interactive stderr."""

    def __init__(self, total: int):
        self.total, self.count, self.started = total, 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self) -> None:
        self.count += 1
        if self.tty and (self.count % 10 == 0 or self.count == self.total):
            print(f"\rloading GGUF tensors {self.count}/{self.total} ({time.monotonic() - self.started:.1f}s)",
                  end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


@dataclass
class BuiltModel:
    """Everything `load_model` needs from a GGUF to make a `LoadedModel`."""

    config: ModelConfig
    model: nnx.Module
    ple_tables: list[PleTable]
    ple_hashers: list[NgramHasher] | None
    tokenizer: object
    report: GGUFReport


def build_from_gguf(path, dtype, quantize: str | None = None, *, planes: int = 1, group: int = 128,
                    gpu_experts: int | None = None, host_experts=None, quant_options: dict | None = None,
                    verbose: bool = True, prefill_attention: str = "auto") -> BuiltModel:
    """Reads a GGUF (or split set) into a filled model without MTP, its PLE table and hashers, its tokenizer, and the
    report; prints the report's lines on stderr (`verbose`). ``prefill_attention``: the config's
    ``prefill_attention_impl``."""
    from strata_jax.model.decoder import CausalLM
    from strata_jax.weights.gguf_tokenizer import tokenizer_from_gguf

    if quantize not in (None, "1bit"):
        raise ValueError(f"quantize must be None or '1bit', got {quantize!r}")
    g = GGUFFile(path)
    cfg = replace(config_from_gguf(g), prefill_attention_impl=prefill_attention)
    quant = plan_experts(g, cfg, quantize, planes, group, gpu_experts, **(quant_options or {}))
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype, with_mtp=False, quant=quant, host_experts=host_experts))
    report = fill_params_from_gguf(model, cfg, g, dtype)
    tables = load_ple_tables_gguf(g, cfg)
    hashers = ple_hashers(ple_hash(g), cfg, tables)
    tokenizer = tokenizer_from_gguf(g) if g.get("tokenizer.ggml.tokens") else None
    if tokenizer is None:
        report.missing.append("tokenizer (no tokenizer.ggml.* metadata)")
    if verbose:
        for line in report.lines():
            print(f"gguf: {line}", file=sys.stderr)
    return BuiltModel(cfg, model, tables, hashers, tokenizer, report)


def gguf_shapes(path) -> tuple[ModelConfig, ExpertQuantization | None]:
    """(config, expert format) of a GGUF from its header alone (the planner's and `serve`'s view before loading)."""
    g = GGUFFile(path)
    cfg = config_from_gguf(g)
    return cfg, plan_experts(g, cfg, None, 1, 128, None)
