"""GGUF files: bad files give clear errors (never a crash), split sets read like one file, metadata -> config.

The small files here are written with the `gguf` package's own writer: a qwen3next header with the metadata keys
llama.cpp's converter writes, and the expert tensors of one layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType, GGUFWriter

import strata_jax
from strata_jax.weights.gguf_config import config_from_gguf
from strata_jax.weights.gguf_convert import check_expert_shapes, expert_tensors
from strata_jax.weights.gguf_reader import GGUFError, GGUFFile

H, I, E = 128, 128, 4  # noqa: E741 - hidden, moe_intermediate, experts


def _write(path: Path, arch: str = "qwen3next", experts: int = E, tensors=None, split: tuple[int, int] | None = None,
           meta: bool = True) -> Path:
    w = GGUFWriter(str(path), arch)
    if meta:
        for key, value in {"block_count": 1, "embedding_length": H, "attention.head_count": 2,
                           "attention.head_count_kv": 1, "attention.key_length": 32, "ssm.time_step_rank": 4,
                           "ssm.group_count": 2, "ssm.state_size": 16, "ssm.inner_size": 64, "ssm.conv_kernel": 4,
                           "expert_count": experts, "expert_used_count": 2, "expert_feed_forward_length": I,
                           "expert_shared_feed_forward_length": 32, "context_length": 4096,
                           "full_attention_interval": 1}.items():
            w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.rope.freq_base", 10000.0)
        w.add_uint32(f"{arch}.rope.dimension_count", 8)
        w.add_key_value("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)], GGUFValueType.ARRAY,
                        sub_type=GGUFValueType.STRING)
    if split:
        w.add_uint16("split.no", split[0])
        w.add_uint16("split.count", split[1])
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {f"blk.0.ffn_{k}_exps.weight": rng.standard_normal((E, I, H) if k != "down" else (E, H, I))
                   .astype(np.float32) for k in ("gate", "up", "down")}
    for name, arr in tensors.items():
        if isinstance(arr, tuple):  # (raw bytes, numpy shape, type)
            raw, _shape, qtype = arr
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_metadata_and_config(tmp_path):
    g = GGUFFile(_write(tmp_path / "m.gguf"))
    cfg = config_from_gguf(g)
    assert (cfg.family, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size) == ("qwen3_next", H, E, I)
    assert cfg.layer_types == ("full_attention",) and cfg.rotary_dim == 8 and cfg.linear_v_dim == 16
    ex = expert_tensors(g, 0)
    assert [t.shape for t in ex.all] == [(E, I, H), (E, I, H), (E, H, I)]
    np.testing.assert_array_equal(g.dequantize("blk.0.ffn_gate_exps.weight").shape, (E, I, H))


def test_wrong_magic(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        strata_jax.load_model(bad)


def test_truncated_file_names_the_tensor(tmp_path):
    path = _write(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"truncated: tensor 'blk\.0\.ffn_down_exps\.weight'"):
        GGUFFile(path)
    path.write_bytes(data[:40])  # inside the header
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        GGUFFile(path)


def test_unknown_architecture(tmp_path):
    path = _write(tmp_path / "m.gguf", arch="llama")
    with pytest.raises(GGUFError, match="architecture 'llama' is not supported"):
        strata_jax.load_model(path)


def test_unknown_tensor_type_names_tensor_and_type(tmp_path):
    raw = np.zeros((E, I, H // 32 * 34), np.uint8)
    path = _write(tmp_path / "m.gguf", tensors={"blk.0.ffn_gate_exps.weight": (raw, (E, I, H), QType.Q8_0)})
    data = bytearray(path.read_bytes())
    # the tensor info's type id follows its name, n_dims and dims: patch Q8_0 (8) into an id no ggml has (99)
    name = b"blk.0.ffn_gate_exps.weight"
    at = data.index(name) + len(name) + 4 + 3 * 8
    assert int.from_bytes(data[at : at + 4], "little") == QType.Q8_0
    data[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has ggml type id 99"):
        GGUFFile(path)


def test_unreadable_tensor_type_names_tensor_and_type(tmp_path):
    raw = np.zeros((E, I, H // 256 * 292), np.uint8)  # Q8_K: the activation type, nothing dequantizes it
    path = _write(tmp_path / "m.gguf", tensors={"blk.0.ffn_gate_exps.weight": (raw, (E, I, H * 2), QType.Q8_K)})
    g = GGUFFile(path)
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has type Q8_K"):
        g.dequantize("blk.0.ffn_gate_exps.weight")


def test_shape_mismatch_against_metadata(tmp_path):
    g = GGUFFile(_write(tmp_path / "m.gguf", experts=E + 1))  # metadata says 5 experts, tensors hold 4
    cfg = config_from_gguf(g)
    with pytest.raises(GGUFError, match=r"ffn_gate_exps\.weight' has shape \(4, 128, 128\), the metadata implies "
                                        r"\(5, 128, 128\)"):
        check_expert_shapes(g, cfg, 0, expert_tensors(g, 0))


def test_split_set_reads_as_one(tmp_path):
    rng = np.random.default_rng(1)
    gate = rng.standard_normal((E, I, H)).astype(np.float32)
    down = rng.standard_normal((E, H, I)).astype(np.float32)
    first = _write(tmp_path / "m-00001-of-00002.gguf", tensors={"blk.0.ffn_gate_exps.weight": gate}, split=(0, 2))
    _write(tmp_path / "m-00002-of-00002.gguf", tensors={"blk.0.ffn_down_exps.weight": down}, split=(1, 2),
           meta=False)
    g = GGUFFile(tmp_path / "m-00002-of-00002.gguf")  # any part names the set
    assert g.parts == [first, tmp_path / "m-00002-of-00002.gguf"]
    np.testing.assert_array_equal(g.dequantize("blk.0.ffn_gate_exps.weight"), gate)
    np.testing.assert_array_equal(g.dequantize("blk.0.ffn_down_exps.weight"), down)
    assert config_from_gguf(g).num_experts == E
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GGUFError, match="m-00002-of-00002.gguf missing"):
        GGUFFile(first)


def test_string_arrays_read_as_gguf_reads_them(tmp_path):
    """The reader's fast path for arrays of strings (tokenizer tokens and merges) gives the `gguf` package's own
    fields, part for part; a file cut inside such an array is a clear error."""
    from gguf import GGUFReader

    from strata_jax.weights.gguf_reader import _CheckedReader

    strings = ["a", "", "Ġthe", "naïve", "<|im_end|>", "x" * 300] * 50
    path = tmp_path / "s.gguf"
    w = GGUFWriter(str(path), "qwen3next")
    w.add_key_value("tokenizer.ggml.tokens", strings, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value("x.ids", [1, 2, 3], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want, got = GGUFReader(str(path)), _CheckedReader(path)
    assert list(got.fields) == list(want.fields)
    for key, f in want.fields.items():
        g = got.fields[key]
        assert (g.types, g.data, g.offset, g.contents()) == (f.types, f.data, f.offset, f.contents()), key
        assert [p.tobytes() for p in g.parts] == [p.tobytes() for p in f.parts], key
    assert GGUFFile(path).get("tokenizer.ggml.tokens") == strings
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"x" * 300) + 100])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        GGUFFile(path)
