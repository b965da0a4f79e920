"""Draft models cut from a checkpoint's own layers (strata_jax.weights.layer_draft), on the bundled demo model."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import strata_jax
from strata_jax.demo import DEMO_MODEL
from strata_jax.model.cache import init_cache
from strata_jax.weights.layer_draft import main, make_layer_draft


def test_layer_draft_is_the_source_model_truncated(tmp_path):
    out = make_layer_draft(DEMO_MODEL, tmp_path / "draft", [0])
    draft = strata_jax.load_model(out, dtype="float32")
    assert draft.config.num_layers == 1 and not draft.config.ple_layers and not draft.has_mtp
    assert (out / "tokenizer.json").read_bytes() == (DEMO_MODEL / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["layer_types"] == ["linear_attention"]

    # Reference: the demo model's own embedding, layer 0, final mixer and LM head, composed by hand.
    source = strata_jax.load_model(DEMO_MODEL, dtype="float32")
    lm = nnx.merge(source.graphdef, source.state)
    tokens = np.asarray([source.tokenizer.encode("def add(a, b):\n    return a + b\n")], np.int32)
    t = tokens.shape[1]
    h = jnp.tile(lm.model.embed_tokens(jnp.asarray(tokens)), (1, 1, source.config.hc_count))
    cache = init_cache(source.config, 1, t, jnp.float32).layers[0]
    h, _, _ = lm.model.layers[0](h, cache, jnp.zeros(1, jnp.int32), jnp.full(1, t, jnp.int32), None)
    h, _, _ = lm.model.hyper_connection_mixer(h)
    want = np.asarray(lm.logits(h))
    got = draft.logits(tokens)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_layer_draft_refuses_ple_layers_and_bad_indices(tmp_path, capsys):
    ple_layer = strata_jax.load_model(DEMO_MODEL).config.ple_layers[0]
    with pytest.raises(ValueError, match="PLE"):
        make_layer_draft(DEMO_MODEL, tmp_path / "x", [ple_layer])
    assert main(["--model", str(DEMO_MODEL), "--out", str(tmp_path / "y"), "--layers", "0,9"]) == 2
    assert "subset of 0..3" in capsys.readouterr().err
