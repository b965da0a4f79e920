"""The bundled demo checkpoint (strata_jax/demo, made by `python -m tools.train_demo`): it has every
qwen4_exp building block and writes code-like text."""

import json

import pytest

from strata_jax.demo import DEMO_MODEL

DEMO = DEMO_MODEL


@pytest.fixture(scope="module")
def demo():
    import strata_jax

    return strata_jax.load_model(DEMO, dtype="float32")


def test_demo_config_has_every_block(demo):
    cfg = demo.config
    raw = json.loads((DEMO / "config.json").read_text())
    assert raw["model_type"] == "qwen4_exp_text" and cfg.family == "qwen4_exp"
    assert cfg.qsa and cfg.hyper_connections and cfg.hc_count == 4
    assert cfg.ple_layers and cfg.num_experts > 1 and cfg.shared_expert_intermediate_size > 0
    assert any(cfg.layer_is_linear(i) for i in range(cfg.num_layers))
    assert not all(cfg.layer_is_linear(i) for i in range(cfg.num_layers))
    assert demo.has_mtp
    assert cfg.hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0
    tok = demo.tokenizer
    for special in ("<|im_end|>", "<think>", "<tool_call>", "<tool_response>"):
        assert tok.token_to_id(special) is not None
    assert tok.eos_token == "<|im_end|>"


def test_demo_writes_code(demo):
    tok = demo.tokenizer
    prompt = "import os\n\n\ndef list_python_files(directory):\n"
    ids = demo.generate(tok.encode(prompt), max_new_tokens=24, stop_at_eos=False)
    text = tok.decode(ids)
    assert len(ids) == 24
    assert text.startswith("    ")  # the body of the function is indented
    assert any(s in text for s in ("(", ":", "return", "self.", '"""')), text


def test_demo_chat_prompt_renders_and_generates(demo):
    tok = demo.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = demo.generate(tok.encode(prompt), max_new_tokens=24)
    text = tok.decode(ids)
    # The tiny model answers in the template's shape (reasoning first) and ends its turn; it is not a good coder.
    assert text.startswith("<think>"), text
    assert ids[-1] == tok.token_to_id("<|im_end|>") or len(ids) == 24
