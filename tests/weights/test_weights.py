"""Checkpoint reading: layouts (fused / per-expert, sharded, bf16) and the errors bad checkpoints must give."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import strata_jax
from conftest import FIXTURES
from strata_jax.model.config import ConfigError
from strata_jax.weights.safetensors_io import CheckpointError

SRC = FIXTURES / "ckpt" / "qwen4_exp_causal"


def _copy(tmp_path, transform=None):
    """Copies the fixture checkpoint, passing its tensors through `transform(dict) -> dict`."""
    dst = tmp_path / "ckpt"
    shutil.copytree(SRC, dst)
    if transform is not None:
        tensors = load_file(dst / "model.safetensors")
        save_file(transform(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _fuse_experts(tensors: dict) -> dict:
    out, experts = {}, {}
    for name, arr in tensors.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[-3].isdigit():
            base = ".".join(parts[:-3])
            experts.setdefault(base, {})[(int(parts[-3]), parts[-2])] = arr
        else:
            out[name] = arr
    for base, d in experts.items():
        n = max(e for e, _ in d) + 1
        out[f"{base}.gate_up_proj"] = np.stack(
            [np.concatenate([d[(e, "gate_proj")], d[(e, "up_proj")]]) for e in range(n)]
        )
        out[f"{base}.down_proj"] = np.stack([d[(e, "down_proj")] for e in range(n)])
    return out


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(SRC / "reference.npz"))


def test_fused_experts_load_like_per_expert(tmp_path, reference):
    model = strata_jax.load_model(_copy(tmp_path, _fuse_experts))
    got = model.logits(reference["input_ids"][:1, :16])
    want = reference["logits"][:1, :16]
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-4


def test_bf16_checkpoint_in_bf16(tmp_path, reference):
    to_bf16 = lambda t: {k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v) for k, v in t.items()}  # noqa: E731
    model = strata_jax.load_model(_copy(tmp_path, to_bf16), dtype="bfloat16")
    got = model.logits(reference["input_ids"][:1, :16])
    want = reference["logits"][:1, :16]
    assert got.dtype == np.float32
    # bf16 weights and activations through 8 layers: a few percent, and the top token mostly agrees.
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 0.15
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.75


def test_missing_tensor_is_named(tmp_path):
    def drop(t):
        t.pop("model.layers.3.self_attn.k_norm.weight")
        return t

    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_norm\.weight"):
        strata_jax.load_model(_copy(tmp_path, drop))


def test_misshaped_tensor_is_named(tmp_path):
    def bad(t):
        t["model.layers.0.linear_attn.in_proj_z.weight"] = t["model.layers.0.linear_attn.in_proj_z.weight"][:, :10]
        return t

    with pytest.raises(CheckpointError, match=r"in_proj_z\.weight.*shape \(64, 10\), expected \(64, 64\)"):
        strata_jax.load_model(_copy(tmp_path, bad))


def test_truncated_file(tmp_path):
    dst = _copy(tmp_path)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated|cannot read"):
        strata_jax.load_model(dst)


def test_unknown_model_type(tmp_path):
    dst = _copy(tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "llama_weird"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama_weird'"):
        strata_jax.load_model(dst)


def test_sharded_index_with_missing_shard(tmp_path):
    dst = tmp_path / "cond"
    shutil.copytree(FIXTURES / "ckpt" / "qwen4_exp_cond", dst)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        strata_jax.load_model(dst)


def test_no_weights_at_all(tmp_path):
    dst = tmp_path / "empty"
    dst.mkdir()
    shutil.copy(SRC / "config.json", dst / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        strata_jax.load_model(dst)


def test_ple_table_is_memory_mapped():
    model = strata_jax.load_model(SRC)
    (table,) = model._ple_tables
    assert len(table.shards) == 4 and all(isinstance(s, np.memmap) for s in table.shards)
