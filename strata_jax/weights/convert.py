"""`python -m strata_jax quantize`: a HF checkpoint -> a converted directory with packed experts, written with
orbax-checkpoint one part at a time (embeddings/head, each decoder layer, MTP), so memory holds one layer, never
the model. Each part is its own orbax checkpoint, committed atomically: re-running skips finished parts, so an
interrupted conversion resumes. The PLE tables are copied as safetensors (they stay memory-mapped on the host).

Layout of a converted directory:
    strata_quant.json            format, planes, group, dtype, source
    config.json, tokenizer files copied from the source
    params/<part>/               orbax checkpoints: {our parameter path: array}
    ple.safetensors              PLE tables (only for models with PLE layers)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import save_file

from strata_jax.model.config import ExpertQuantization, ModelConfig, load_config
from strata_jax.model.decoder import CausalLM
from strata_jax.model.moe import QuantizedExperts
from strata_jax.weights.loader import _read, has_mtp
from strata_jax.weights.onebit import quantize_experts
from strata_jax.weights.safetensors_io import CheckpointError, CheckpointReader

FORMAT = "strata_jax-packed-v1"
MARKER = "strata_quant.json"
_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "chat_template.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def is_converted(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def read_marker(path: Path) -> dict:
    meta = json.loads((Path(path) / MARKER).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _part_of(path: tuple) -> str:
    """Which part file a parameter path belongs to."""
    if len(path) > 2 and path[0] == "model" and path[1] == "layers":
        return f"layer_{int(path[2]):03d}"
    if path[0] == "mtp":
        return "mtp"
    return "base"


def plan_parts(model: nnx.Module) -> dict[str, list]:
    """Parameter paths grouped by part; packed-expert modules appear once, as (path, module)."""
    packed = {p: n for p, n in nnx.iter_graph(model) if isinstance(n, QuantizedExperts)}
    parts: dict[str, list] = defaultdict(list)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and path[:-1] not in packed:
            parts[_part_of(path)].append((path, node))
    for path, module in packed.items():
        parts[_part_of(path)].append((path, module))
    return dict(parts)


def _convert_part(entries, cfg: ModelConfig, reader: CheckpointReader, dtype) -> dict[str, np.ndarray]:
    out = {}
    for path, node in entries:
        name = ".".join(str(p) for p in path)
        if isinstance(node, QuantizedExperts):
            e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            for kind, shape in (("gate_up", (e, 2 * i, h)), ("down", (e, h, i))):
                dense = _read(reader, cfg, f"{name}.{kind}_proj", shape).astype(np.float32)
                packed = quantize_experts(dense, group=node.quant.group, planes=node.quant.planes)
                out[f"{name}.{kind}_bits"] = packed.bits
                out[f"{name}.{kind}_scales"] = packed.scales
        else:
            out[name] = _read(reader, cfg, name, tuple(node.shape)).astype(np.dtype(dtype), copy=False)
    return out


def convert_checkpoint(src: str | Path, out: str | Path, *, group: int = 128, planes: int = 1,
                       dtype: str = "bfloat16") -> dict:
    """Converts `src` (HF directory) into `out`; returns the marker metadata. Safe to re-run."""
    src, out = Path(src), Path(out)
    cfg = load_config(src)
    reader = CheckpointReader(src)
    quant = ExpertQuantization(planes=planes, group=group)
    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    meta = {"format": FORMAT, "planes": planes, "group": group, "dtype": dtype, "source": str(src.resolve())}
    if is_converted(out):
        old = read_marker(out)
        if {k: old.get(k) for k in ("planes", "group", "dtype")} != {k: meta[k] for k in ("planes", "group", "dtype")}:
            raise ValueError(f"{out} holds a conversion with other settings {old}; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "params").mkdir(exist_ok=True)
    model = nnx.eval_shape(lambda: CausalLM(cfg, jdtype, with_mtp=has_mtp(reader), quant=quant))
    parts = plan_parts(model)
    checkpointer = ocp.StandardCheckpointer()
    started = time.monotonic()
    for done, (part, entries) in enumerate(sorted(parts.items()), 1):
        target = out / "params" / part
        if (target / "commit_success.txt").is_file() or (target / "_CHECKPOINT_METADATA").is_file():
            _progress(done, len(parts), part, started, "exists, skipped")
            continue
        if target.exists():
            shutil.rmtree(target)  # a part left half-written by an interrupted run
        arrays = _convert_part(entries, cfg, reader, dtype)
        checkpointer.save(target.resolve(), arrays)
        checkpointer.wait_until_finished()
        _progress(done, len(parts), part, started, "")
    _copy_ple(cfg, reader, out)
    for name in _COPY:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    (out / MARKER).write_text(json.dumps(meta, indent=2))
    return meta


def _copy_ple(cfg: ModelConfig, reader: CheckpointReader, out: Path) -> None:
    if not cfg.ple_layers or (out / "ple.safetensors").is_file():
        return
    tensors = {}
    for name in reader.names():
        if ".ple.ple_embedding.ngram_embedding." in name:
            tensors[name] = np.asarray(reader.memmap(name))
    tmp = out / "ple.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "ple.safetensors")


def _progress(done: int, total: int, part: str, started: float, note: str) -> None:
    elapsed = time.monotonic() - started
    eta = elapsed / done * (total - done)
    print(f"quantize: [{done}/{total}] {part} {note} ({elapsed:.0f}s, ~{eta:.0f}s left)", file=sys.stderr, flush=True)


def restore_params(model: nnx.Module, path: Path) -> None:
    """Fills an abstract model from a converted directory's orbax parts."""
    checkpointer = ocp.StandardCheckpointer()
    for part, entries in plan_parts(model).items():
        target = (Path(path) / "params" / part).resolve()
        if not target.is_dir():
            raise CheckpointError(f"{target} is missing: the conversion did not finish (re-run quantize)")
        arrays = checkpointer.restore(target)
        for p, node in entries:
            name = ".".join(str(x) for x in p)
            names = (
                [f"{name}.{k}" for k in ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")]
                if isinstance(node, QuantizedExperts)
                else [name]
            )
            for n in names:
                if n not in arrays:
                    raise CheckpointError(f"tensor {n!r} not found in {target}")
            if isinstance(node, QuantizedExperts):
                for k in ("gate_up", "down"):
                    node.load(k, arrays[f"{name}.{k}_bits"], arrays[f"{name}.{k}_scales"])
            else:
                arr = arrays[name]
                if tuple(arr.shape) != tuple(node.shape):
                    raise CheckpointError(f"tensor {name!r} has shape {arr.shape}, expected {tuple(node.shape)}")
                node.set_value(jnp.asarray(arr, node.dtype))


def convert_from_gguf(src: str | Path, out: str | Path, *, dtype: str = "bfloat16", planes: int | None = None,
                      group: int | None = None) -> dict:
    """A llama.cpp GGUF (or split set) -> a converted directory (`python -m strata_jax quantize --from-gguf`).

    The experts keep the format the GGUF load chose (`strata_jax.weights.gguf_loader.plan_experts`: Q1_0 / TQ*_0
    bit for bit), or `planes`/`group` when given; config.json and the tokenizer files are written from the GGUF's
    metadata. PLE models are refused: a converted directory re-derives the PLE hash from a seed the GGUF lacks."""
    from strata_jax.weights.gguf_config import hf_config_dict
    from strata_jax.weights.gguf_loader import build_from_gguf
    from strata_jax.weights.gguf_reader import GGUFError, GGUFFile
    from strata_jax.weights.gguf_tokenizer import tokenizer_files

    src, out = Path(src), Path(out)
    g = GGUFFile(src)
    raw = hf_config_dict(g)
    if raw.get("ple_layer_ids"):
        raise GGUFError(f"{src} has a PLE layer: load the GGUF directly (a converted directory derives the PLE hash "
                        "from a seed the GGUF does not store)")
    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    quantize = "1bit" if planes or group else None
    built = build_from_gguf(src, jdtype, quantize, planes=planes or 1, group=group or 128)
    quant = next((n.quant for _, n in nnx.iter_graph(built.model) if isinstance(n, QuantizedExperts)), None)
    if quant is None:
        raise GGUFError(f"{src}: its experts are not in a 1-2 bit type; pass --planes/--group to pack them")
    meta = {"format": FORMAT, "planes": quant.planes, "group": quant.group, "dtype": dtype,
            "source": str(src.resolve()), "gguf": {"exact": len(built.report.exact), "repacked": built.report.repacked}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "params").mkdir(exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    started = time.monotonic()
    parts = plan_parts(built.model)
    for done, (part, entries) in enumerate(sorted(parts.items()), 1):
        arrays = {}
        for path, node in entries:
            name = ".".join(str(p) for p in path)
            if isinstance(node, QuantizedExperts):
                for k in ("gate_up", "down"):
                    arrays[f"{name}.{k}_bits"] = np.asarray(getattr(node, f"{k}_bits")[...])
                    arrays[f"{name}.{k}_scales"] = np.asarray(getattr(node, f"{k}_scales")[...])
            else:
                arrays[name] = np.asarray(node[...])
        target = out / "params" / part
        if target.exists():
            shutil.rmtree(target)
        checkpointer.save(target.resolve(), arrays)
        checkpointer.wait_until_finished()
        _progress(done, len(parts), part, started, "")
    raw["architectures"] = ["Qwen4ExpForCausalLM" if raw["model_type"] == "qwen4_exp_text" else "Qwen3NextForCausalLM"]
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    tok_json, tok_config = tokenizer_files(g)
    (out / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False, indent=2))
    (out / MARKER).write_text(json.dumps(meta, indent=2))
    return meta
