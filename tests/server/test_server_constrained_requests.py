"""What the server asks the engine for: the `Constraint` each API request becomes (offered tools and their schemas,
tool_choice, response formats, thinking), sent through the real `anthropic` and `openai` SDKs to a server over the
scripted engine, which records the submitted requests. The constraint's grammar is compiled here too, so a mapping
the engine would refuse fails this test."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer

from server.app import create_app
from strata_jax.engine.constraints import lark_grammar
from strata_jax.engine.protocol import Constraint, ToolSchema

WRITE = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
         "required": ["path", "content"]}
RUN = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
ANTHROPIC_TOOLS = [{"name": "write_file", "input_schema": WRITE}, {"name": "run_command", "input_schema": RUN}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": WRITE}},
                {"type": "function", "function": {"name": "run_command", "parameters": RUN}}]
TOOL_SCHEMAS = (ToolSchema("write_file", json.dumps(WRITE)), ToolSchema("run_command", json.dumps(RUN)))
ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
USER = [{"role": "user", "content": "Do it."}]


@pytest.fixture(scope="module")
def servers():
    tokenizer = fixture_tokenizer()
    out = {}
    for constrain in (True, False):
        engine = ScriptedEngine(tokenizer, "Done.")
        app = create_app(engine, tokenizer, served_name="m", api_key=None, context_length=engine.context_length,
                         constrain_tools=constrain)
        out[constrain] = (ServerThread(app), engine)
    yield out
    for server, _ in out.values():
        server.stop()


def _sent(servers, constrain: bool, api: str, **kwargs) -> Constraint | None:
    server, engine = servers[constrain]
    if api == "anthropic":
        anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0).messages.create(
            model="m", max_tokens=8, messages=kwargs.pop("messages", USER), **kwargs)
    else:
        openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0).chat.completions.create(
            model="m", max_tokens=8, messages=kwargs.pop("messages", USER), **kwargs)
    constraint = engine.submitted[-1].sampling.constraint
    if constraint is not None:
        lark_grammar(constraint)  # raises for a constraint the engine could not compile
    return constraint


def test_anthropic_tools_and_tool_choice(servers):
    thinking_off = {"thinking": False, "starts_in_thinking": False}  # the template closed an empty <think> block
    assert _sent(servers, True, "anthropic", tools=ANTHROPIC_TOOLS) == Constraint(tools=TOOL_SCHEMAS, **thinking_off)
    for choice, engine_choice in (({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                  ({"type": "tool", "name": "run_command"}, "run_command")):
        assert _sent(servers, True, "anthropic", tools=ANTHROPIC_TOOLS, tool_choice=choice) == Constraint(
            tools=TOOL_SCHEMAS, tool_choice=engine_choice, **thinking_off)
    assert _sent(servers, True, "anthropic", tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}) == Constraint(
        tool_choice="none", **thinking_off)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert _sent(servers, True, "anthropic", tools=ANTHROPIC_TOOLS, thinking=thinking).thinking
    # No tools, no format: nothing to constrain. --no-constrain-tools: tools are free.
    assert _sent(servers, True, "anthropic") is None
    assert _sent(servers, False, "anthropic", tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}) is None
    with pytest.raises(anthropic.BadRequestError, match="tool_choice.name"):
        _sent(servers, True, "anthropic", tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "search"})


def test_anthropic_structured_output(servers):
    fmt = {"format": {"type": "json_schema", "schema": ANSWER}}
    expected = Constraint(json_schema=json.dumps(ANSWER), thinking=False)
    assert _sent(servers, True, "anthropic", output_config=fmt) == expected
    assert _sent(servers, False, "anthropic", output_config=fmt) == expected  # the flag is about tools only
    assert _sent(servers, True, "anthropic", extra_body={"output_format": fmt["format"]}) == expected
    # With tools offered the tools' grammar holds (one grammar cannot yet be "JSON or calls").
    assert _sent(servers, True, "anthropic", output_config=fmt, tools=ANTHROPIC_TOOLS).tools == TOOL_SCHEMAS
    for bad, match in (({"format": {"type": "xml", "schema": ANSWER}}, "expected json_schema"),
                       ({"format": {"type": "json_schema"}}, "schema"),
                       ({"format": {"type": "json_schema", "schema": {"type": 3}}}, "type")):
        with pytest.raises(anthropic.BadRequestError, match=match):
            _sent(servers, True, "anthropic", output_config=bad)
    prefilled = USER + [{"role": "assistant", "content": "{"}]
    with pytest.raises(anthropic.BadRequestError, match="prefilled"):
        _sent(servers, True, "anthropic", output_config=fmt, messages=prefilled)


def test_openai_tool_choice_and_response_format(servers):
    may_think = {"thinking": True, "starts_in_thinking": False}  # no enable_thinking: the answer may open <think>
    assert _sent(servers, True, "openai", tools=OPENAI_TOOLS) == Constraint(tools=TOOL_SCHEMAS, **may_think)
    for choice, engine_choice in (("auto", "auto"), ("required", "required"),
                                  ({"type": "function", "function": {"name": "write_file"}}, "write_file")):
        assert _sent(servers, True, "openai", tools=OPENAI_TOOLS, tool_choice=choice) == Constraint(
            tools=TOOL_SCHEMAS, tool_choice=engine_choice, **may_think)
    assert _sent(servers, True, "openai", tools=OPENAI_TOOLS, tool_choice="none") == Constraint(
        tool_choice="none", **may_think)
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    assert not _sent(servers, True, "openai", tools=OPENAI_TOOLS, extra_body=no_think).thinking
    assert _sent(servers, False, "openai", tools=OPENAI_TOOLS, tool_choice="required") is None
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name"):
        _sent(servers, True, "openai", tools=OPENAI_TOOLS,
              tool_choice={"type": "function", "function": {"name": "search"}})

    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    for fmt, schema in (({"type": "json_object"}, {"type": "object"}), (schema_format, ANSWER),
                        ({"type": "json_schema", "json_schema": {"name": "a"}}, {"type": "object"})):
        for constrain in (True, False):
            assert _sent(servers, constrain, "openai", response_format=fmt) == Constraint(
                json_schema=json.dumps(schema), **may_think)
    assert _sent(servers, True, "openai", response_format={"type": "text"}) is None
    for bad, match in (({"type": "xml"}, "response_format.type"), ({"type": "json_schema"}, "json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}, "strict")):
        with pytest.raises(openai.BadRequestError, match=match):
            _sent(servers, True, "openai", response_format=bad)
