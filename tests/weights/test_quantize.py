"""1-bit experts end to end: quantize-on-load, the converted (orbax) directory, resuming, and the effect of
plane count on the fixture model's logits."""

import shutil

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from strata_jax.__main__ import main as cli
from strata_jax.weights.convert import convert_checkpoint

SRC = FIXTURES / "ckpt" / "qwen4_exp_causal"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(SRC / "reference.npz"))


def test_more_planes_track_the_dense_model_better(ref):
    errors, agree = [], []
    for planes in (1, 2, 3):
        logits = strata_jax.load_model(SRC, quantize="1bit", planes=planes, group=64).logits(ref["input_ids"])
        errors.append(np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max())
        agree.append(np.mean(logits.argmax(-1) == ref["logits"].argmax(-1)))
    assert errors[0] > errors[1] > errors[2]
    assert agree[2] >= agree[0]


def test_converted_directory_equals_quantize_on_load(tmp_path, ref):
    out = tmp_path / "q"
    assert cli(["quantize", "--model", str(SRC), "--out", str(out), "--planes", "2", "--group", "64",
                "--dtype", "float32"]) == 0
    converted = strata_jax.load_model(out).logits(ref["input_ids"][:1])
    on_load = strata_jax.load_model(SRC, quantize="1bit", planes=2, group=64).logits(ref["input_ids"][:1])
    np.testing.assert_array_equal(converted, on_load)
    assert strata_jax.load_model(out).tokenizer is not None


def test_rerun_resumes_and_rewrites_half_written_parts(tmp_path, ref):
    out = tmp_path / "q"
    convert_checkpoint(SRC, out, planes=1, group=128, dtype="float32")
    want = strata_jax.load_model(out).logits(ref["input_ids"][:1])
    shutil.rmtree(out / "params" / "layer_003")
    (out / "params" / "layer_005" / "commit_success.txt").unlink(missing_ok=True)
    (out / "params" / "layer_005" / "_CHECKPOINT_METADATA").unlink(missing_ok=True)
    convert_checkpoint(SRC, out, planes=1, group=128, dtype="float32")
    np.testing.assert_array_equal(strata_jax.load_model(out).logits(ref["input_ids"][:1]), want)


def test_conflicting_rerun_is_refused(tmp_path):
    out = tmp_path / "q"
    convert_checkpoint(SRC, out, planes=1, group=128, dtype="float32")
    with pytest.raises(ValueError, match="other settings"):
        convert_checkpoint(SRC, out, planes=2, group=128, dtype="float32")
