"""`python -m strata_jax.bench --mode gguf` at the tiny preset: the random-weight GGUF it writes is a qwen4exp file
our loader reads back into the preset's shapes (Q1_0 experts bit for bit), and the mode times the loads and decodes.
(llama.cpp itself loads and runs the tiny file too: checked by hand with tests/fixtures/gguf/llama_dump.cpp.)"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from strata_jax.bench.gguf import synthetic_vocab, tensor_specs, write_random_gguf
from strata_jax.bench.synthetic import preset_config
from strata_jax.weights.gguf_config import config_from_gguf
from strata_jax.weights.gguf_reader import GGUFFile


def test_written_file_reads_back_as_the_preset(tmp_path):
    cfg = preset_config("tiny")
    path = tmp_path / "tiny.gguf"
    size = write_random_gguf(path, cfg, progress=False)
    specs = tensor_specs(cfg)
    g = GGUFFile(path)
    assert size > sum(s.nbytes for s in specs)
    assert sorted(g.names()) == sorted(s.name for s in specs)
    for s in specs:
        assert g.info(s.name).shape == s.shape and g.info(s.name).type_name == s.type_name, s.name
    assert g.info("blk.0.ffn_gate_exps.weight").type_name == "Q1_0"  # 128-wide rows; down (64) falls back to Q8_0
    got = config_from_gguf(g)
    tokens, _, _, eos = synthetic_vocab(cfg.vocab_size)
    # the file's own vocabulary decides eos; intermediate_size (dense-MLP layers, none here) is written as the
    # shared expert's like llama.cpp's converter; eps is stored as float32
    differ = {f.name for f in dataclasses.fields(cfg) if getattr(got, f.name) != getattr(cfg, f.name)}
    assert differ <= {"eos_token_ids", "intermediate_size", "rms_norm_eps"}, differ
    assert got.eos_token_ids == (eos,) and tokens[eos] == "<|im_end|>"
    a = g.dequantize("blk.1.ffn_up_exps.weight")
    assert a.shape == (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size) and np.isfinite(a).all()
    assert (g.dequantize("blk.0.ssm_a") < 0).all()


def test_gguf_mode_times_loads_and_decodes(tmp_path):
    from strata_jax.bench.main import main

    out = tmp_path / "rows.json"
    assert main(["--mode", "gguf", "--preset", "tiny", "--users", "1", "--prompt-tokens", "16", "--gen-tokens", "4",
                 "--prefill-chunks", "16", "--gguf-dir", str(tmp_path / "w"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    head, decode = rows[0], rows[1:]
    assert head["load_gguf_s"] > 0 and head["load_converted_s"] > 0 and head["convert_s"] > 0
    assert head["file_gb"] > 0.002 and head["converted_gb"] > 0
    assert any("mapped bit for bit" in line for line in head["gguf_report"])
    assert [r["users"] for r in decode] == [1] and decode[0]["per_user_tok_s"] > 0
    assert not list((tmp_path / "w").iterdir())  # removed without --gguf-keep
