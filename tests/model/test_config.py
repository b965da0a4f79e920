"""ModelConfig from HF config.json."""

import json

import pytest

from conftest import FIXTURES
from strata_jax.model.config import ConfigError, ModelConfig, load_config


def test_wrapper_text_config_matches_causal():
    causal = load_config(FIXTURES / "ckpt" / "qwen4_exp_causal")
    cond = load_config(FIXTURES / "ckpt" / "qwen4_exp_cond")
    assert cond.weight_prefix == "model.language_model."
    assert causal.weight_prefix == "model."
    assert cond == causal.__class__(**{**causal.__dict__, "weight_prefix": cond.weight_prefix})


def test_qwen4_fields():
    cfg = load_config(FIXTURES / "ckpt" / "qwen4_exp_causal")
    assert cfg.family == "qwen4_exp" and cfg.qsa and cfg.hyper_connections
    assert cfg.layer_types.count("full_attention") == 2
    assert cfg.ple_layers == (1,) and cfg.rotary_dim == 8 and cfg.gdn_gate_act == "sigmoid"


def test_qwen3_next_fields():
    cfg = load_config(FIXTURES / "ckpt" / "qwen3_next")
    assert cfg.family == "qwen3_next" and not cfg.qsa and not cfg.hyper_connections
    assert not cfg.gdn_split_projections and cfg.gdn_gate_act == "silu"


def test_config_is_frozen():
    cfg = load_config(FIXTURES / "ckpt" / "qwen3_next")
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "bert"}, "unsupported model_type"),
        ({"ple_layer_ids": [4]}, "PLE layer 4 must be a linear_attention layer"),
        ({"indexer_budget": 6}, "divisible"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_bad_configs(change, message):
    raw = json.loads((FIXTURES / "ckpt" / "qwen4_exp_causal" / "config.json").read_text())
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(raw)
