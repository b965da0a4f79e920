"""On a GPU: the model runs on the device in both dtypes and still matches the reference."""

import jax
import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen4_exp_causal", "qwen3_next"])
def test_model_on_gpu(name):
    path = FIXTURES / "ckpt" / name
    ref = dict(np.load(path / "reference.npz"))
    model = strata_jax.load_model(path)
    assert jax.tree_util.tree_leaves(model._state)[0].devices().pop().platform == "gpu"
    got = model.logits(ref["input_ids"])
    assert np.max(np.abs(got - ref["logits"])) / np.max(np.abs(ref["logits"])) <= 1e-4
    bf16 = strata_jax.load_model(path, dtype="bfloat16").logits(ref["input_ids"])
    assert np.mean(bf16.argmax(-1) == ref["logits"].argmax(-1)) >= 0.75
