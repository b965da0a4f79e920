"""Constrained decoding with the demo model: JSON-schema answers parse and validate, tool calls name offered tools
only with arguments following their schemas, and unconstrained greedy output is unchanged beside them."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import strata_jax
from engine_helpers import tokens
from strata_jax.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from strata_jax.engine.constraints import ConstraintCompiler, lark_grammar, mask_words, unpack_mask
from strata_jax.engine.protocol import Constraint, ToolSchema

DEMO = Path(strata_jax.__file__).parent / "demo"
SCHEMA = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["count", "ok"], "additionalProperties": False}
TOOLS = (
    ToolSchema("write_file", json.dumps({"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["create", "append"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["mode", "size"]})),
    ToolSchema("run_command", json.dumps({"type": "object", "properties": {
        "timeout": {"type": "integer", "minimum": 1, "maximum": 60}}, "required": ["timeout"]})),
)


@pytest.fixture(scope="module")
def model():
    return strata_jax.load_model(DEMO)


def _prompt(model, text, tools=None):
    return tuple(model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tools=tools, add_generation_prompt=True, tokenize=False)))


def test_masks_allow_exactly_the_grammar(model):
    """The packed mask agrees with the grammar token by token on a valid answer, and forbids a made-up tool."""
    tok = model.tokenizer
    compiler = ConstraintCompiler(tok, model.config.vocab_size, tok.eos_token_ids)
    assert compiler.tool_format == "qwen_xml"
    answer = tok.encode("<tool_call>\n<function=run_command>\n<parameter=timeout>\n30\n</parameter>\n</function>\n"
                        "</tool_call>") + [tok.token_to_id("<|im_end|>")]
    matcher = compiler.matcher(Constraint(tools=TOOLS, tool_choice="required", thinking=False))
    row = np.zeros(mask_words(model.config.vocab_size), np.int32)
    for t in answer:
        matcher.fill(row)
        assert unpack_mask(row, model.config.vocab_size)[t]
        assert matcher.advance([t])
    bad = compiler.matcher(Constraint(tools=TOOLS, tool_choice="required", thinking=False))
    assert not bad.advance(tok.encode("<tool_call>\n<function=search_code>"))
    with pytest.raises(ValueError):
        lark_grammar(Constraint(tools=TOOLS, tool_choice="missing_tool"))


def test_constrained_answers_follow_their_grammar(model):
    engine = Engine(model, EngineConfig(slots=3, max_context=512, prefill_chunks=(64, 256), prefix_cache_mib=0))
    engine.start()
    free_prompt = _prompt(model, "Write a haiku about the sea.")
    openai_tools = [{"type": "function", "function": {"name": t.name, "parameters": json.loads(t.parameters)}}
                    for t in TOOLS]
    try:
        async def run(prompt, constraint, max_tokens=64):
            params = SamplingParams(max_tokens=max_tokens, constraint=constraint)
            stream = await engine.submit(GenerationRequest(prompt, params))
            return [ev async for ev in stream]

        async def all_three():
            return await asyncio.gather(
                run(_prompt(model, "Reply in JSON with a count and ok."),
                    Constraint(json_schema=json.dumps(SCHEMA), thinking=False)),
                run(_prompt(model, "Write hello.py and run it.", openai_tools),
                    Constraint(tools=TOOLS, tool_choice="required"), 96),
                run(free_prompt, None, 24))

        as_json, as_tools, free = asyncio.run(all_three())
    finally:
        engine.shutdown()
    text = "".join(ev.text for ev in as_json)
    assert as_json[-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    text = "".join(ev.text for ev in as_tools)
    assert as_tools[-1].finish_reason == "stop", text
    calls = re.findall(r"<function=([^>]*)>\n(.*?)</function>", text, re.S)
    assert calls, text
    schemas = {t.name: json.loads(t.parameters) for t in TOOLS}
    for name, body in calls:
        assert name in schemas
        args = {k: v for k, v in re.findall(r"<parameter=([^>]*)>\n(.*?)\n</parameter>", body, re.S)}
        args = {k: (v if schemas[name]["properties"][k].get("type") == "string" else json.loads(v))
                for k, v in args.items()}
        jsonschema.validate(args, schemas[name])
    # Beside constrained slots, an unconstrained greedy request is exactly the model's own greedy output.
    assert tokens(free) == model.generate(list(free_prompt), 24, stop_at_eos=False)[: len(tokens(free))]
