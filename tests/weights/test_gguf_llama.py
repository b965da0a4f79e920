"""Our loads of llama.cpp GGUF files against llama.cpp's own outputs for the same files.

The fixtures (tests/fixtures/gguf, written by tests/fixtures/make_gguf_fixtures.py): tiny random qwen4exp (`q4e`,
with hyper-connections and a PLE layer) and qwen3next (`q3n`) models converted by llama.cpp's convert_hf_to_gguf.py
and quantized by libllama's `llama_model_quantize` (routed experts Q1_0, the rest as its Q8_0 file type chooses:
Q8_0, F16 for rows shorter than a block, F32 for 1-D tensors / router / indexer), plus llama.cpp's logits (prompt
rows `logit_rows`), 12 greedy tokens and tokenizations. The variants `f32`, `bf16` and `q1_0_f32dense` hold the same
weights in other types; they are re-derived here from the committed file with the generator's `derive_variant`.

Tolerance: max |ours - llama.cpp| / max |llama.cpp| over the committed prompt logits, per variant. llama.cpp's CPU
matmuls convert their activations to the weight type's dot-product type, which we do not: Q8_0 for Q8_0 and Q1_0
weights, BF16 for BF16, F16 for F16. F32 weights are the one exact case. Measured q4e / q3n (all 24 prompt rows):
f32 7.9e-5 / 2.6e-4, bf16 7.1e-3 / 7.1e-3, q1_0_f32dense 8.8e-4 / 5.4e-3, q1_0 (committed) 2.2e-2 / 2.0e-2. The
committed file's error is llama.cpp's own: its run of that file differs as much (2.2e-2 / 2.0e-2) from its run of
the same weights in F32, and its greedy tokens leave the F32 run's after 2 tokens on q4e; ours follow the F32 run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import strata_jax
from strata_jax.weights.gguf_reader import GGUFFile
from strata_jax.weights.gguf_tokenizer import tokenizer_from_gguf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GGUF_DIR = FIXTURES / "gguf"
MANIFEST = json.loads((GGUF_DIR / "manifest.json").read_text())
TAGS = ("q4e", "q3n")
# Calibrated on the fixtures (measured values in the module docstring), with 2-5x headroom.
TOLERANCE = {"f32": 1e-3, "bf16": 2.5e-2, "q1_0_f32dense": 1.5e-2, "q1_0": 5e-2}
# Variants whose greedy continuation equals llama.cpp's token for token. The committed file's (Q8_0 activations in
# llama.cpp) is checked against llama.cpp's run of the same weights in F32 instead.
GREEDY_EQUAL = ("f32", "bf16", "q1_0_f32dense")


def _generator():
    spec = importlib.util.spec_from_file_location("make_gguf_fixtures", FIXTURES / "make_gguf_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(tag: str) -> dict[str, np.ndarray]:
    return dict(np.load(GGUF_DIR / f"{tag}.llama.npz"))


def _file(tag: str, variant: str, tmp_path: Path) -> Path:
    committed = GGUF_DIR / MANIFEST[tag]["file"]
    if variant == "q1_0":
        return committed
    return _generator().derive_variant(committed, tmp_path / f"{tag}-{variant}.gguf", variant)


def _prompt_logits_and_greedy(model, ids: list[int], new_tokens: int) -> tuple[np.ndarray, list[int]]:
    """Prompt logits [T, V] (one prefill, as llama_dump runs it) and the greedy continuation (argmax, first max)."""
    seqs = model.start(1, len(ids) + new_tokens)
    logits, _, seqs = model.step(seqs, np.asarray([ids], np.int32))
    prompt = np.asarray(logits[0])
    out: list[int] = []
    last = prompt[-1]
    for _ in range(new_tokens):
        out.append(int(np.argmax(last)))
        logits, _, seqs = model.step(seqs, np.asarray([[out[-1]]], np.int32))
        last = np.asarray(logits[0, -1])
    return prompt, out


def _relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("variant", ["f32", "bf16", "q1_0_f32dense", "q1_0"])
def test_logits_and_greedy_match_llama_cpp(tag, variant, tmp_path):
    ref = _reference(tag)
    ids = [int(x) for x in ref["ids"]]
    model = strata_jax.load_model(_file(tag, variant, tmp_path))
    prompt, greedy = _prompt_logits_and_greedy(model, ids, len(ref[f"greedy_{variant}"]))
    ours = prompt[ref["logit_rows"]]
    err = _relative(ours, ref[f"logits_{variant}"])
    assert err <= TOLERANCE[variant], f"{tag} {variant}: relative logit error {err:.3g}"
    assert np.array_equal(ours.argmax(-1), ref[f"logits_{variant}"].argmax(-1))
    if variant in GREEDY_EQUAL:
        assert greedy == ref[f"greedy_{variant}"].tolist()
    else:
        # The same weights run by llama.cpp in F32 (no activation quantization): ours match it as closely as the
        # Q1_0 experts' fp16 -> bf16 scale rounding allows, and give its greedy tokens.
        assert _relative(ours, ref["logits_f32"]) <= TOLERANCE["q1_0_f32dense"]
        assert greedy == ref["greedy_f32"].tolist()
        assert greedy[0] == int(ref["greedy_q1_0"][0])


@pytest.mark.parametrize("tag", TAGS)
def test_tokenization_matches_llama_cpp(tag):
    """llama_tokenize (no BOS, special tokens parsed) of a few strings, against the tokenizer built from the GGUF's
    own tokenizer.ggml.* metadata."""
    tok = tokenizer_from_gguf(GGUFFile(GGUF_DIR / MANIFEST[tag]["file"]))
    texts = [t.replace("\\n", "\n").replace("\\t", "\t") for t in MANIFEST[tag]["texts"]]
    assert len(texts) == len(MANIFEST[tag]["tokens"]) >= 5
    for text, want in zip(texts, MANIFEST[tag]["tokens"]):
        assert tok.encode(text) == want, text


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(model.state)]


def test_split_set_loads_like_the_single_file(tmp_path):
    """The committed q4e file rewritten as a 4-part split set (gguf-py's writer; the generator checked that llama.cpp
    gives identical logits for such a set): every parameter, the PLE table and the tokenizer are the same."""
    committed = GGUF_DIR / MANIFEST["q4e"]["file"]
    parts = _generator().copy_gguf(committed, tmp_path / "q4e.gguf", split_max_tensors=20)
    assert [p.name for p in parts] == [f"q4e-0000{i}-of-00004.gguf" for i in range(1, 5)]
    single, split = strata_jax.load_model(committed), strata_jax.load_model(parts[2])  # any part names the set
    assert split.config == single.config
    for a, b in zip(_leaves(split), _leaves(single), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(split._ple_tables[0].shards, single._ple_tables[0].shards, strict=True):
        np.testing.assert_array_equal(a, b)
    text = MANIFEST["q4e"]["texts"][2]
    assert split.tokenizer.encode(text) == single.tokenizer.encode(text)


def test_quantize_from_gguf_round_trip(tmp_path):
    """`python -m strata_jax quantize --from-gguf` writes a directory that loads to the GGUF's logits and greedy
    tokens (q3n: a converted directory cannot hold q4e's PLE hash constants)."""
    src = GGUF_DIR / MANIFEST["q3n"]["file"]
    out = tmp_path / "q3n"
    r = subprocess.run([sys.executable, "-m", "strata_jax", "quantize", "--from-gguf", str(src), "--out", str(out),
                        "--dtype", "float32"], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 plane(s), group 128" in r.stdout
    ref = _reference("q3n")
    ids = [int(x) for x in ref["ids"]]
    from_dir = _prompt_logits_and_greedy(strata_jax.load_model(out), ids, 12)
    from_gguf = _prompt_logits_and_greedy(strata_jax.load_model(src), ids, 12)
    np.testing.assert_allclose(from_dir[0], from_gguf[0], rtol=0, atol=1e-5)
    assert from_dir[1] == from_gguf[1] == ref["greedy_f32"].tolist()
    tok = strata_jax.load_model(out).tokenizer
    assert [tok.encode(t.replace("\\n", "\n")) for t in MANIFEST["q3n"]["texts"][:3]] == MANIFEST["q3n"]["tokens"][:3]


def test_engine_serves_a_gguf(capfd):
    """The engine on `load_model(X.gguf)`: the startup report says what the file lacks (the MTP head) and a request
    gets llama.cpp's greedy tokens for the prompt."""
    from engine_helpers import collect, tokens
    from strata_jax.engine import Engine
    from strata_jax.engine.config import EngineConfig

    model = strata_jax.load_model(GGUF_DIR / MANIFEST["q3n"]["file"])
    err = capfd.readouterr().err
    assert "gguf: not in the file: MTP head" in err and "running without the MTP drafter" in err
    assert "gguf: experts: packed, 1 plane(s), group 128 (bit for bit)" in err
    ref = _reference("q3n")
    eng = Engine(model, EngineConfig(slots=2, max_context=64, prefill_chunks=(32,)))
    eng.start()
    try:
        events = asyncio.run(collect(eng, tuple(int(x) for x in ref["ids"]), max_tokens=12))
    finally:
        eng.shutdown()
    assert tokens(events) == ref["greedy_q1_0"].tolist()
