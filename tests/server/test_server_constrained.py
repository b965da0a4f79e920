"""Constrained tool calls and JSON answers through the real `anthropic` and `openai` SDKs, over the real engine
serving the bundled demo model: one engine behind two servers, one with the default (offered tools are the answer's
grammar) and one as `serve --no-constrain-tools` runs it. The demo model is weak enough to call a tool nobody offered
(`search_code`), which is what the constraint must prevent; greedy answers are checked against the model itself
(`LoadedModel.generate`)."""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import jsonschema
import openai
import pytest
from server_helpers import ServerThread

from server.app import create_app
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine import Engine, EngineConfig

WRITE = {"type": "object", "properties": {
    "path": {"type": "string", "enum": ["hello.py", "main.py", "README.md"]},
    "mode": {"type": "string", "enum": ["create", "append"]},
    "lines": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["path", "mode"]}
RUN = {"type": "object", "properties": {
    "command": {"type": "string", "enum": ["python hello.py", "ls", "make test"]},
    "timeout": {"type": "integer", "minimum": 1, "maximum": 600}}, "required": ["command"]}
SCHEMAS = {"write_file": WRITE, "run_command": RUN}
ANTHROPIC_TOOLS = [{"name": name, "description": f"{name} tool", "input_schema": schema}
                   for name, schema in SCHEMAS.items()]
OPENAI_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
                for name, schema in SCHEMAS.items()]
ANSWER = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["alpha", "beta"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["name", "count", "ok"], "additionalProperties": False}
PROMPTS = ["Write hello.py that prints hello, then run it.", "Find where parse_args is defined.",
           "Search the code for TODO comments."]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def served():
    import strata_jax

    model = strata_jax.load_model(DEMO_MODEL, dtype="float32")
    engine = Engine(model, EngineConfig(slots=4, max_context=1024, prefill_chunks=(128,)))
    engine.start()
    servers = {constrain: ServerThread(create_app(engine, model.tokenizer, served_name="demo", api_key=None,
                                                  context_length=engine.context_length, constrain_tools=constrain))
               for constrain in (True, False)}
    yield servers, model
    for server in servers.values():
        server.stop()
    engine.shutdown()


def _anthropic(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _openai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _together(*calls):
    """Runs the calls concurrently (the engine's slots batch them) and returns their results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _message(server, prompt, temperature=0.0, **kwargs):
    return lambda: _anthropic(server).messages.create(
        model="demo", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}],
        extra_body={"temperature": temperature}, **kwargs)


def _chat(server, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    return lambda: _openai(server).chat.completions.create(
        model="demo", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}], **kwargs)


def _uses(message):
    return [(block.name, block.input) for block in message.content if block.type == "tool_use"]


def _calls(choice):
    return [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls or []]


def _assert_valid(calls, cut=False):
    """Every call names an offered tool and its arguments follow the tool's schema. `cut`: the answer ended at
    max_tokens, so its last call may be unfinished (the API returns it as far as it got, as Anthropic's does): that
    one is checked only for its name and for naming no argument outside the schema."""
    for i, (name, args) in enumerate(calls):
        assert name in SCHEMAS, f"a call to {name!r}, which was not offered"
        if cut and i == len(calls) - 1:
            assert set(args) <= set(SCHEMAS[name]["properties"]), args
        else:
            jsonschema.validate(args, SCHEMAS[name])


def _greedy(model, messages, max_tokens, **template):
    """The model's own greedy answer to `messages` (end-of-turn token dropped), decoded."""
    tok = model.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template))
    out = [t for t in model.generate(ids, max_tokens) if t not in tok.eos_token_ids]
    return tok.decode(out)


def test_calls_name_only_offered_tools_with_valid_arguments(served):
    servers, _ = served
    on = servers[True]
    greedy = _together(*[_message(on, p, tools=ANTHROPIC_TOOLS) for p in PROMPTS])
    sampled = _together(*[_message(on, PROMPTS[0], temperature=1.0, tools=ANTHROPIC_TOOLS) for _ in range(4)])
    for message in greedy + sampled:
        calls = _uses(message)
        assert message.stop_reason in (("tool_use", "max_tokens") if calls else ("end_turn", "max_tokens")), message
        _assert_valid(calls, cut=message.stop_reason == "max_tokens")
    assert all(_uses(m) for m in greedy)  # unconstrained, the demo calls `search_code` here (the last test)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    sampled = _together(*[_chat(on, PROMPTS[1], tools=OPENAI_TOOLS, tool_choice="required", temperature=1.0,
                                seed=seed, extra_body=no_thinking) for seed in range(4)])
    for out in sampled:
        assert out.choices[0].finish_reason == "tool_calls" and _calls(out.choices[0])
        _assert_valid(_calls(out.choices[0]))


def test_tool_choice_is_enforced(served):
    servers, _ = served
    on = servers[True]
    any_, named, none = _together(
        _message(on, PROMPTS[2], tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}),
        _message(on, PROMPTS[2], tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "run_command"}),
        _message(on, PROMPTS[0], tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}))
    assert any_.stop_reason == "tool_use" and all(b.type == "tool_use" for b in any_.content)
    _assert_valid(_uses(any_))
    assert named.stop_reason == "tool_use" and {name for name, _ in _uses(named)} == {"run_command"}
    _assert_valid(_uses(named))
    assert none.stop_reason == "end_turn" and not _uses(none) and none.content[0].text
    required, forced, never = _together(
        _chat(on, PROMPTS[2], tools=OPENAI_TOOLS, tool_choice="required"),
        _chat(on, PROMPTS[2], tools=OPENAI_TOOLS, tool_choice={"type": "function",
                                                                "function": {"name": "write_file"}}),
        _chat(on, PROMPTS[0], tools=OPENAI_TOOLS, tool_choice="none"))
    assert required.choices[0].finish_reason == "tool_calls"
    _assert_valid(_calls(required.choices[0]))
    assert {name for name, _ in _calls(forced.choices[0])} == {"write_file"}
    _assert_valid(_calls(forced.choices[0]))
    assert not never.choices[0].message.tool_calls and never.choices[0].message.content
    with pytest.raises(anthropic.BadRequestError, match="not one of the offered tools"):
        _message(on, PROMPTS[0], tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "search_code"})()


def test_json_answers_parse_and_follow_the_schema(served):
    servers, _ = served
    on = servers[True]
    prompt = "Reply in JSON with a name, a count and ok."
    as_object, as_schema, as_text = _together(
        _chat(on, prompt, response_format={"type": "json_object"}),
        _chat(on, prompt, response_format={"type": "json_schema",
                                           "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}),
        _chat(on, prompt, response_format={"type": "text"}))
    assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    jsonschema.validate(json.loads(as_schema.choices[0].message.content), ANSWER)
    with pytest.raises(json.JSONDecodeError):  # the demo does not answer in JSON by itself
        json.loads(as_text.choices[0].message.content)
    message = _message(on, prompt, output_config={"format": {"type": "json_schema", "schema": ANSWER}})()
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[-1].text), ANSWER)


def test_unconstrained_answers_are_the_models_own(served):
    """Without tools or a format nothing is masked: the greedy answer beside constrained requests is the model's own;
    and with --no-constrain-tools a tools request is answered as the model writes it, made-up tool and all."""
    servers, model = served
    on, off = servers[True], servers[False]
    prompt = "Write a function that reverses a string."
    plain, *_ = _together(_chat(on, prompt), _chat(on, PROMPTS[0], tools=OPENAI_TOOLS, tool_choice="required"),
                          _message(on, PROMPTS[1], tools=ANTHROPIC_TOOLS))
    expected = _greedy(model, [{"role": "user", "content": prompt}], MAX_TOKENS)
    reasoning, _, answer = expected.partition("</think>")
    message = plain.choices[0].message
    assert message.content == answer.strip()
    assert getattr(message, "reasoning_content", "") == reasoning.replace("<think>", "").strip()

    free, constrained = _together(_message(off, PROMPTS[0], tools=ANTHROPIC_TOOLS),
                                  _message(on, PROMPTS[0], tools=ANTHROPIC_TOOLS))
    as_rendered = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                     "description": t["description"]}} for t in ANTHROPIC_TOOLS]
    raw = _greedy(model, [{"role": "user", "content": PROMPTS[0]}], MAX_TOKENS, enable_thinking=False,
                  tools=as_rendered)
    made_up = [(name, args) for name, args in _uses(free) if name not in SCHEMAS]
    assert made_up, free.content
    for name, args in made_up:
        assert f"<function={name}>" in raw and all(f"<parameter={k}>\n{v}\n" in raw for k, v in args.items()), raw
    _assert_valid(_uses(constrained))
    assert _uses(constrained)
