"""Every field of an Anthropic Messages request is type-checked: a wrong type is a 400 `invalid_request_error` in
Anthropic's shape naming the field (never silently accepted, never reaching the engine), while unknown fields and
block types and missing optional fields still pass (docs/CLIENTS.md)."""

import anthropic
import pytest
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer, httpx

from server.app import create_app

USER = [{"role": "user", "content": "hi"}]
OK = {"model": "m", "max_tokens": 5, "messages": USER}


def _assistant(*blocks):
    return {"messages": [*USER, {"role": "assistant", "content": list(blocks)}, {"role": "user", "content": "go"}]}


def _user(*blocks):
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def _result(**fields):
    return _user({"type": "tool_result", "tool_use_id": "toolu_1", **fields})


@pytest.fixture(scope="module")
def served():
    tokenizer = fixture_tokenizer()
    engine = ScriptedEngine(tokenizer, "Hi.")
    server = ServerThread(create_app(engine, tokenizer, served_name="m", api_key=None, context_length=4096))
    yield server, engine
    server.stop()


@pytest.mark.parametrize("patch, message", [
    ({"stop_sequences": "x"}, "stop_sequences: expected an array, got string"),
    ({"stop_sequences": ["ok", 1]}, "stop_sequences.1: expected a string, got integer"),
    ({"metadata": "u"}, "metadata: expected an object, got string"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id: expected a string, got integer"),
    ({"system": 7}, "system: expected a string or a list of text blocks, got integer"),
    ({"system": ["x"]}, "system.0: expected an object, got string"),
    ({"system": [{"type": "text", "text": 5}]}, "system.0.text: expected a string, got integer"),
    ({"system": [{"type": 5, "text": "x"}]}, "system.0.type: expected a string, got integer"),
    ({"system": [{"type": "text", "text": "x", "cache_control": "no"}]}, "system.0.cache_control: expected an "
                                                                         "object, got string"),
    ({"tool_choice": "auto"}, "tool_choice: expected an object, got string"),
    ({"tool_choice": {}}, "tool_choice.type: field required"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name: field required"),
    ({"tool_choice": {"type": "tool", "name": 3}}, "tool_choice.name: expected a string, got integer"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use: expected a boolean, got string"),
    ({"thinking": "on"}, "thinking: expected an object, got string"),
    ({"thinking": {"budget_tokens": 2048}}, "thinking.type: field required"),
    ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens: expected an integer"),
    ({"temperature": "hot"}, "temperature: expected a finite number"),
    ({"top_p": [1]}, "top_p: expected a finite number"),
    ({"top_k": 1.5}, "top_k: expected an integer"),
    ({"stream": "yes"}, "stream: expected a boolean, got string"),
    ({"model": 5}, "model: expected a string, got integer"),
    ({"tools": [{"name": 5, "input_schema": {"type": "object"}}]}, "tools.0.name: expected a string, got integer"),
    ({"tools": [{"name": "f", "input_schema": "x"}]}, "tools.0.input_schema: expected an object, got string"),
    ({"tools": [{"name": "f", "description": 5, "input_schema": {}}]}, "tools.0.description: expected a string"),
    ({"tools": ["f"]}, "tools.0: expected an object, got string"),
    (_user({"text": "no type"}), "messages.0.content.0.type: field required"),
    (_user({"type": 5}), "messages.0.content.0.type: expected a string, got integer"),
    (_user({"type": "text"}), "messages.0.content.0.text: field required"),
    (_user({"type": "text", "text": "x", "cache_control": 1}), "messages.0.content.0.cache_control: expected an "
                                                               "object"),
    (_user({"type": "image", "source": "x"}), "messages.0.content.0.source: expected an object, got string"),
    (_user({"type": "document", "source": {}, "title": 5}), "messages.0.content.0.title: expected a string"),
    (_result(is_error="no"), "messages.0.content.0.is_error: expected a boolean, got string"),
    (_result(content=5), "messages.0.content.0.content: expected a string or a list of content blocks"),
    (_result(content=[{"type": "text", "text": 5}]), "messages.0.content.0.content.0.text: expected a string"),
    (_user({"type": "tool_result", "tool_use_id": 5}), "messages.0.content.0.tool_use_id: expected a string"),
    (_user({"type": "tool_result"}), "messages.0.content.0.tool_use_id: field required"),
    (_assistant({"type": "tool_use", "id": "toolu_1", "name": "f", "input": "x"}),
     "messages.1.content.0.input: expected an object, got string"),
    (_assistant({"type": "tool_use", "name": "f", "input": {}}), "messages.1.content.0.id: field required"),
    (_assistant({"type": "tool_use", "id": 7, "name": "f", "input": {}}), "messages.1.content.0.id: expected a "
                                                                          "string"),
    (_assistant({"type": "thinking", "thinking": 5, "signature": "s"}), "messages.1.content.0.thinking: expected a "
                                                                        "string"),
    (_assistant({"type": "thinking", "thinking": "t", "signature": 5}), "messages.1.content.0.signature: expected "
                                                                        "a string"),
    (_assistant({"type": "redacted_thinking", "data": None}), "messages.1.content.0.data: field required"),
])
def test_wrong_types_are_anthropic_400s(served, patch, message):
    server, engine = served
    before = len(engine.submitted)
    r = httpx.post(server.url + "/v1/messages", json={**OK, **patch}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": r.json()["error"][
        "message"]}}
    assert message in r.json()["error"]["message"]
    assert len(engine.submitted) == before


def test_the_sdk_sees_a_bad_request(served):
    server, _ = served
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=5, messages=USER, stop_sequences="x")
    assert "stop_sequences: expected an array" in info.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=USER, system=[{"type": "text", "text": 5}])


def test_valid_and_unknown_shapes_still_pass(served):
    server, engine = served
    body = {
        **OK,
        "metadata": {"user_id": None},
        "stop_sequences": None,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "adaptive"},
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": True},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "brand_new_block", "x": 1},
                                         {"type": "image", "source": {"type": "base64", "data": ""}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": "s"},
                {"type": "redacted_thinking", "data": "abc"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "ok"}], "is_error": False}]},
        ],
    }
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and engine.submitted
