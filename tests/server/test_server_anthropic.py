"""The Anthropic Messages API as the official `anthropic` SDK and Claude Code use it, against a real server on
127.0.0.1 whose engine is the `ScriptedEngine` token-stream seam (tests/server_helpers.py)."""

import json
import re
import time

import anthropic
import pytest
from server_helpers import CLAUDE_CODE_FIXTURES, ScriptedEngine, ServerThread, fixture_tokenizer, httpx, parse_sse

from server.app import create_app

TOOLS = [
    {
        "name": "Write",
        "description": "Write a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["file_path", "content"],
        },
    },
    {
        "name": "Read",
        "description": "Read a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
        },
    },
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},  # a server tool: dropped
]

TOOL_OUTPUT = (
    "<think>\nThe user wants a file.\n</think>\n\nWriting it now.\n\n"
    "<tool_call>\n<function=Write>\n<parameter=file_path>\n/tmp/hello.py\n</parameter>\n"
    '<parameter=content>\nprint("hello")\n</parameter>\n</function>\n</tool_call>\n'
    "<tool_call>\n<function=Read>\n<parameter=file_path>\n/tmp/hello.py\n</parameter>\n"
    "<parameter=limit>\n10\n</parameter>\n</function>\n</tool_call>"
)
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture
def serve(tokenizer):
    """serve(engine=None, **create_app kwargs) -> (ServerThread, engine); stopped after the test."""
    servers = []

    def start(engine=None, *, loading=False, **kwargs):
        engine = engine or ScriptedEngine(tokenizer, "Hello there!")
        kwargs.setdefault("served_name", "strata-demo")
        kwargs.setdefault("api_key", None)
        kwargs.setdefault("context_length", engine.context_length)
        app = create_app(None if loading else engine, None if loading else tokenizer, **kwargs)
        server = ServerThread(app)
        servers.append(server)
        return server, engine

    yield start
    for server in servers:
        server.stop()


def client(server, **kwargs):
    kwargs.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, **kwargs)


# ---------------------------------------------------------------------------------------------------------- happy paths


def test_create_text_and_usage(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, "Hello there!", cached_tokens=5))
    c = client(server)
    msg = c.messages.create(model="claude-opus-4-9", max_tokens=64, messages=USER, extra_body={"temperature": 0})
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello there!"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.model == "claude-opus-4-9"
    assert msg.id.startswith("msg_")
    total = msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.cache_creation_input_tokens
    assert total == len(engine.submitted[0].prompt_ids)
    assert msg.usage.cache_read_input_tokens == 5
    assert msg.usage.output_tokens == len(tokenizer.encode("Hello there!")) + 1  # + the eos token
    assert engine.submitted[0].sampling.temperature == 0.0
    count = c.messages.count_tokens(model="x", messages=USER)
    assert count.input_tokens == total


def test_stream_accumulates_thinking_text_and_tool_use(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, TOOL_OUTPUT))
    c = client(server)
    with c.messages.stream(model="m", max_tokens=500, messages=USER, tools=TOOLS,
                           thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        texts = [event.text for event in stream if event.type == "text"]
        final = stream.get_final_message()
    assert "".join(texts) == "Writing it now."
    kinds = [b.type for b in final.content]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "The user wants a file." and final.content[0].signature
    write, read = final.content[2], final.content[3]
    assert write.name == "Write" and write.input == {"file_path": "/tmp/hello.py", "content": 'print("hello")'}
    assert read.name == "Read" and read.input == {"file_path": "/tmp/hello.py", "limit": 10}
    for block in (write, read):
        assert re.fullmatch(r"toolu_[A-Za-z0-9]+", block.id)
    assert write.id != read.id
    assert final.stop_reason == "tool_use"
    # server tool dropped, the two custom tools rendered through the chat template
    prompt = engine.prompt_text()
    assert "<name>Write</name>" in prompt and "<name>Read</name>" in prompt and "web_search" not in prompt


def test_raw_sse_event_order(serve, tokenizer):
    server, _ = serve(ScriptedEngine(tokenizer, TOOL_OUTPUT))
    body = {"model": "m", "max_tokens": 500, "stream": True, "messages": USER, "tools": TOOLS,
            "thinking": {"type": "adaptive"}}
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"].startswith("req_")
    frames = parse_sse(r.text)
    check_anthropic_stream(frames)
    names = [name for name, _ in frames]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"
    # thinking block: deltas, then one signature_delta, then stop
    thinking = [d for n, d in frames if n == "content_block_delta" and d["index"] == 0]
    assert thinking[-1]["delta"]["type"] == "signature_delta" and thinking[-1]["delta"]["signature"]
    assert all(d["delta"]["type"] == "thinking_delta" for d in thinking[:-1])


def check_anthropic_stream(frames):
    """The invariants a client relies on: names repeat types, message_start first, blocks in index order with one
    start/stop each, tool input deltas forming valid JSON, message_delta then message_stop last."""
    assert frames, "empty stream"
    for name, data in frames:
        assert name is not None and name == data["type"], (name, data)
    frames = [f for f in frames if f[0] != "ping"]
    assert frames[0][0] == "message_start"
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and "input_tokens" in start["usage"]
    assert [n for n, _ in frames[-2:]] == ["message_delta", "message_stop"]
    delta = frames[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert isinstance(delta["usage"]["output_tokens"], int)
    open_index, expected_index, json_parts = None, 0, []
    for name, data in frames[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == expected_index
            open_index, block = data["index"], data["content_block"]
            json_parts = [] if block["type"] == "tool_use" else None
            if block["type"] == "tool_use":
                assert block["input"] == {} and re.fullmatch(r"[a-zA-Z0-9_-]+", block["id"])
        elif name == "content_block_delta":
            assert data["index"] == open_index
            if data["delta"]["type"] == "input_json_delta":
                json_parts.append(data["delta"]["partial_json"])
        elif name == "content_block_stop":
            assert data["index"] == open_index
            if json_parts is not None:
                assert isinstance(json.loads("".join(json_parts)), dict)
            open_index, expected_index = None, expected_index + 1
        else:
            raise AssertionError(f"unexpected event {name}")
    assert open_index is None


def test_thinking_hidden_unless_requested(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, "<think>\nsecret\n</think>\n\nVisible."))
    msg = client(server).messages.create(model="m", max_tokens=64, messages=USER)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Visible."
    assert engine.prompt_text().endswith("<think>\n\n</think>\n\n")  # enable_thinking=False in the template


def test_max_tokens_and_stop_sequences(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, "one two three four five six seven"))
    c = client(server)
    msg = c.messages.create(model="m", max_tokens=3, messages=USER)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    msg = c.messages.create(model="m", max_tokens=100, messages=USER, stop_sequences=["four"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "four"
    assert msg.content[0].text == "one two three"
    # max_tokens is clamped to the context that is left, not rejected
    assert raw_post(server, {"model": "m", "max_tokens": 10**6, "messages": USER}).status_code == 200
    assert engine.submitted[-1].sampling.max_tokens == engine.context_length - len(engine.submitted[-1].prompt_ids)


def test_stream_with_max_tokens_inside_a_tool_call(serve, tokenizer):
    server, _ = serve(ScriptedEngine(tokenizer, TOOL_OUTPUT))
    r = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 40, "stream": True, "messages": USER, "tools": TOOLS})
    frames = parse_sse(r.text)
    check_anthropic_stream(frames)
    assert frames[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_models(serve):
    server, _ = serve()
    c = client(server)
    page = c.models.list()
    assert [m.id for m in page.data] == ["strata-demo"]
    assert page.data[0].type == "model" and page.data[0].created_at
    assert c.models.retrieve("strata-demo").id == "strata-demo"
    with pytest.raises(anthropic.NotFoundError):
        c.models.retrieve("no-such-model")


# ---------------------------------------------------------------------------------------------------------- conversion


def test_claude_code_shapes_render(serve, tokenizer):
    server, engine = serve()
    c = client(server)
    body = dict(
        model="claude-opus-4",
        max_tokens=100,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.dd4; cch=AAAA;"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug."},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "iVBORw0KGgo="}}]},
            {"role": "system", "content": "Today is Tuesday."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look first.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "a.py", "limit": 5}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": True,
                 "content": [{"type": "text", "text": "no such file"}], "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Try again.", "some_future_field": 1},
                {"type": "future_block_type", "x": 1},
            ]},
        ],
        tools=TOOLS,
        metadata={"user_id": "u"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
    )
    c.messages.create(**body)
    prompt = engine.prompt_text()
    assert "billing-header" not in prompt
    assert prompt.startswith("<|im_start|>system\nYou are a coding agent.")
    assert "Fix the bug.\n[image omitted" in prompt
    assert "<system-reminder>\nToday is Tuesday.\n</system-reminder>" in prompt
    assert "<tool_call>\n<function=Read>\n<parameter=file_path>\na.py\n</parameter>\n<parameter=limit>\n5\n" in prompt
    assert "<tool_response>\nError: no such file\n</tool_response>" in prompt
    assert "Try again." in prompt
    # the attribution line changes per request; the prompt must not
    body["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.dd4; cch=BBBB;"
    c.messages.create(**body)
    assert engine.submitted[-1].prompt_ids == engine.submitted[-2].prompt_ids


def test_tool_choice(serve, tokenizer):
    server, engine = serve()
    c = client(server)
    c.messages.create(model="m", max_tokens=10, messages=USER, tools=TOOLS, tool_choice={"type": "none"})
    assert "<tools>" not in engine.prompt_text()
    c.messages.create(model="m", max_tokens=10, messages=USER, tools=TOOLS, tool_choice={"type": "any"})
    assert "You must answer with a call to one of the available tools" in engine.prompt_text()
    c.messages.create(model="m", max_tokens=10, messages=USER, tools=TOOLS,
                      tool_choice={"type": "tool", "name": "Read"})
    assert "call to the tool `Read`" in engine.prompt_text()


def test_max_tokens_zero_only_warms_the_cache(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, "Not shown."))
    msg = client(server).messages.create(model="m", max_tokens=0, messages=USER)
    assert msg.content == [] and msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 0
    assert engine.submitted[0].sampling.max_tokens == 1


def test_prefill_continues_the_assistant_turn(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, " world"))
    msg = client(server).messages.create(model="m", max_tokens=10, messages=[
        {"role": "user", "content": "say hello world"}, {"role": "assistant", "content": "Hello"}])
    assert engine.prompt_text().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello")
    assert msg.content[0].text == "world"


# ---------------------------------------------------------------------------------------------------------- errors


def raw_post(server, body, path="/v1/messages", **kwargs):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, timeout=30,
                      headers={"content-type": "application/json", **kwargs.pop("headers", {})}, **kwargs)


def assert_anthropic_error(response, status, error_type, text=""):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    assert text in body["error"]["message"]
    assert response.headers["request-id"].startswith("req_")


def test_bad_requests_get_clear_400s(serve):
    server, engine = serve()
    assert_anthropic_error(raw_post(server, b"{not json"), 400, "invalid_request_error", "not valid JSON")
    assert_anthropic_error(raw_post(server, b"[1, 2]"), 400, "invalid_request_error", "JSON object")
    assert_anthropic_error(raw_post(server, b""), 400, "invalid_request_error", "empty")
    ok = {"model": "m", "max_tokens": 5, "messages": USER}
    for patch, needle in [
        ({"max_tokens": "abc"}, "max_tokens: expected an integer"),
        ({"max_tokens": -1}, "max_tokens: must be an integer in 0..2147483647"),
        ({"max_tokens": None}, "max_tokens: field required"),
        ({"messages": "hi"}, "messages: expected an array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages.0.content.0.text"),
        ({"messages": []}, "at least one message"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 5}, "temperature"),
        ({"stop_sequences": [1]}, "stop_sequences"),
        ({"tools": {"a": 1}}, "tools"),
        ({"system": 7}, "system"),
    ]:
        assert_anthropic_error(raw_post(server, {**ok, **patch}), 400, "invalid_request_error", needle)
    assert not engine.submitted, "bad requests must never reach the engine"
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(model="m", max_tokens=5, messages=USER, extra_body={"top_k": -1})


def test_validation_messages_say_what_is_wrong(serve):
    server, engine = serve()
    lone = {"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": "Sure, "}]}
    assert_anthropic_error(raw_post(server, lone), 400, "invalid_request_error",
                           "the conversation has no user message: a final assistant message is a prefill")
    assert_anthropic_error(raw_post(server, lone, path="/v1/messages/count_tokens"), 400, "invalid_request_error",
                           "no user message")
    assert_anthropic_error(raw_post(server, {"model": "m", "max_tokens": 5, "messages": []}), 400,
                           "invalid_request_error", "at least one message is required, got an empty array")
    for body, kind in ((b"null", "null"), (b"7", "integer"), (b'"text"', "string"), (b"1.5", "number")):
        assert_anthropic_error(raw_post(server, body), 400, "invalid_request_error",
                               f"the request body must be a JSON object, got {kind}")
    # A schema whose properties are null: named, instead of the chat template's "'NoneType' object has no ..."
    tool = {"name": "f", "input_schema": {"type": "object", "properties": None}}
    r = raw_post(server, {"model": "m", "max_tokens": 5, "messages": USER, "tools": [tool]})
    assert_anthropic_error(r, 400, "invalid_request_error",
                           "tools.0.input_schema.properties: expected an object mapping parameter names to schemas, "
                           "got null")
    r = raw_post(server, {"model": "m", "max_tokens": 1.5, "messages": USER})
    assert_anthropic_error(r, 400, "invalid_request_error", "max_tokens: expected an integer in 0..2147483647, got "
                           "number 1.5")
    assert not engine.submitted


def test_prompt_too_long(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, context_length=64))
    with pytest.raises(anthropic.BadRequestError) as info:
        client(server).messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 200}])
    assert re.search(r"prompt is too long: \d+ tokens > 63 maximum", info.value.message)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert not engine.submitted


def test_prompt_too_long_from_the_engine(serve, tokenizer):
    # the engine may count differently from the server's own check: its PromptTooLong is a 400 too
    engine = ScriptedEngine(tokenizer, context_length=64)
    server, _ = serve(engine, context_length=100000)
    r = raw_post(server, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 200}]})
    assert_anthropic_error(r, 400, "invalid_request_error", "prompt is too long")


def test_oversized_body(serve):
    server, _ = serve(max_body_bytes=10_000)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 20_000}]}
    assert_anthropic_error(raw_post(server, body), 413, "request_too_large")
    # the server still works
    assert client(server).messages.create(model="m", max_tokens=5, messages=USER).content


def test_auth(serve):
    server, _ = serve(api_key="s3cret")
    with pytest.raises(anthropic.AuthenticationError) as info:
        client(server, api_key="wrong").messages.create(model="m", max_tokens=5, messages=USER)
    assert info.value.body["error"]["type"] == "authentication_error"
    assert client(server, api_key="s3cret").messages.create(model="m", max_tokens=5, messages=USER).content
    # ANTHROPIC_AUTH_TOKEN arrives as a bearer token
    bearer = anthropic.Anthropic(base_url=server.url, auth_token="s3cret", max_retries=0)
    assert bearer.messages.create(model="m", max_tokens=5, messages=USER).content
    assert_anthropic_error(raw_post(server, {"model": "m"}), 401, "authentication_error", "missing API key")
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert httpx.head(server.url + "/").status_code == 200


def test_unknown_path_and_method(serve):
    server, _ = serve()
    assert_anthropic_error(httpx.post(server.url + "/v1/nothing", json={}), 404, "not_found_error")
    assert_anthropic_error(httpx.get(server.url + "/v1/messages"), 405, "invalid_request_error")


def test_loading_then_ready(serve, tokenizer):
    server, engine = serve(loading=True)
    assert httpx.get(server.url + "/health").status_code == 503
    assert httpx.head(server.url + "/").status_code == 200
    assert httpx.get(server.url + "/").json()["status"] == "loading"
    with pytest.raises(anthropic.APIStatusError) as info:
        client(server).messages.create(model="m", max_tokens=5, messages=USER)
    assert info.value.status_code == 529 and info.value.body["error"]["type"] == "overloaded_error"
    assert httpx.get(server.url + "/metrics").status_code == 200  # metrics work while loading
    from server.app import install_engine

    server.call(lambda: install_engine(server.app, engine, tokenizer, engine.context_length))
    assert httpx.get(server.url + "/health").status_code == 200
    assert client(server).messages.create(model="m", max_tokens=5, messages=USER).content


# ---------------------------------------------------------------------------------------------------------- streaming


def test_ping_while_waiting_for_the_first_token(serve, tokenizer):
    server, _ = serve(ScriptedEngine(tokenizer, "Late.", first_token_delay=1.5), ping_interval_s=0.4)
    r = httpx.post(server.url + "/v1/messages", timeout=30,
                   json={"model": "m", "max_tokens": 20, "stream": True, "messages": USER})
    frames = parse_sse(r.text)
    names = [n for n, _ in frames]
    assert names[0] == "message_start" and names[1] == "ping"
    check_anthropic_stream(frames)


def test_disconnect_mid_stream_cancels_in_engine(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, "tick " * 400, token_delay=0.02))
    with httpx.stream("POST", server.url + "/v1/messages", timeout=30,
                      json={"model": "m", "max_tokens": 1000, "stream": True, "messages": USER}) as r:
        for line in r.iter_lines():
            if "text_delta" in line:
                break
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (not engine.cancelled or engine.active):
        time.sleep(0.05)
    assert engine.cancelled == [engine.submitted[0].request_id]
    assert not engine.active
    # other requests are unaffected
    assert client(server).messages.create(model="m", max_tokens=3, messages=USER).stop_reason == "max_tokens"


def test_disconnect_while_waiting_non_streaming(serve, tokenizer):
    server, engine = serve(ScriptedEngine(tokenizer, "slow", first_token_delay=30))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/messages", timeout=0.5,
                   json={"model": "m", "max_tokens": 5, "messages": USER})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not engine.cancelled:
        time.sleep(0.05)
    assert engine.cancelled == [engine.submitted[0].request_id]


def test_metrics(serve, tokenizer):
    server, _ = serve(ScriptedEngine(tokenizer, "Hi there, metrics.", cached_tokens=4))
    c = client(server)
    for _ in range(2):
        c.messages.create(model="m", max_tokens=50, messages=USER)
    raw_post(server, b"{bad")
    text = httpx.get(server.url + "/metrics").text
    assert 'strata_http_requests_total{endpoint="/v1/messages",status="200"} 2.0' in text
    assert 'strata_http_requests_total{endpoint="/v1/messages",status="400"} 1.0' in text
    assert "strata_prefix_cache_hit_tokens_total 8.0" in text
    assert re.search(r"strata_completion_tokens_total \d+", text)
    assert re.search(r"strata_prompt_tokens_total \d+", text)
    assert 'strata_time_to_first_token_seconds_count 2.0' in text
    assert "strata_decode_tokens_per_second_bucket" in text
    assert "strata_slots_busy 0.0" in text and "strata_queue_length 0.0" in text
    assert "strata_engine_requests_total 2.0" in text


# ---------------------------------------------------------------------------------------------------------- Claude Code


@pytest.mark.parametrize("name", ["claude_code_first_turn.json", "claude_code_after_tool_use.json"])
def test_replay_claude_code_requests(serve, tokenizer, name):
    captured = json.loads((CLAUDE_CODE_FIXTURES / name).read_text())
    server, engine = serve(ScriptedEngine(tokenizer, TOOL_OUTPUT, context_length=200_000), api_key="local")
    skip = {"host", "content-length", "connection", "accept-encoding"}
    headers = {k: v for k, v in captured["headers"].items() if k.lower() not in skip}
    # Scrubbed from the capture; docs/CLIENTS.md: Claude Code sent it.
    headers.setdefault("Authorization", "Bearer local")
    r = httpx.post(server.url + captured["path"], content=json.dumps(captured["body"]), headers=headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    frames = parse_sse(r.text)
    check_anthropic_stream(frames)
    final = frames[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use"
    usage = final["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(engine.submitted[0].prompt_ids)
    prompt = engine.prompt_text()
    assert "billing-header" not in prompt and "<system-reminder>" in prompt
    assert prompt.count("<|im_start|>system") == 1
    # count_tokens for the same body agrees with what was submitted
    count_headers = dict(headers)
    r = httpx.post(server.url + "/v1/messages/count_tokens?beta=true", headers=count_headers, timeout=60,
                   content=json.dumps({k: v for k, v in captured["body"].items() if k not in ("stream", "max_tokens")}))
    assert r.status_code == 200 and r.json()["input_tokens"] == len(engine.submitted[0].prompt_ids)


def test_serves_default_context_takes_claude_codes_first_request():
    # `python -m strata_jax serve` with no flags on a CPU: the demo's tokenizer and the context serve chooses. The
    # old default of 4096 tokens refused this request ("prompt is too long").
    from strata_jax.demo import DEMO_MODEL
    from strata_jax.engine.config import EngineConfig
    from strata_jax.engine.planner import choose_context
    from strata_jax.model.config import load_config
    from strata_jax.tokenizer import load_tokenizer

    ctx = choose_context(None, load_config(DEMO_MODEL), None, EngineConfig(slots=4)).tokens
    demo = load_tokenizer(DEMO_MODEL)
    engine = ScriptedEngine(demo, "Hello.", context_length=ctx)
    server = ServerThread(create_app(engine, demo, served_name="demo", api_key="local", context_length=ctx))
    try:
        captured = json.loads((CLAUDE_CODE_FIXTURES / "claude_code_first_turn.json").read_text())
        skip = {"host", "content-length", "connection", "accept-encoding"}
        headers = {k: v for k, v in captured["headers"].items() if k.lower() not in skip}
        headers.setdefault("Authorization", "Bearer local")
        body = {k: v for k, v in captured["body"].items() if k not in ("stream", "max_tokens")}
        r = httpx.post(server.url + "/v1/messages/count_tokens?beta=true", headers=headers, timeout=60,
                       content=json.dumps(body))
        assert r.status_code == 200, r.text
        n = r.json()["input_tokens"]
        assert 4096 < n < ctx
        r = httpx.post(server.url + "/v1/messages?beta=true", headers=headers, timeout=60,
                       content=json.dumps({**body, "max_tokens": 16}))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == n == len(engine.submitted[0].prompt_ids)
    finally:
        server.stop()


def test_next_turn_prompt_extends_the_previous_one(serve, tokenizer):
    # What the prefix cache needs: Claude Code's turn N+1 prompt starts with turn N's prompt, token for token
    # (mid-conversation system messages are folded backwards, the attribution line is dropped).
    server, engine = serve(ScriptedEngine(tokenizer, TOOL_OUTPUT))
    c = client(server)
    system = [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "Agent."}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "make hello.py"}]},
                {"role": "system", "content": "Reminder: be careful."}]
    first = c.messages.create(model="m", max_tokens=500, system=system, messages=messages, tools=TOOLS,
                              thinking={"type": "adaptive"})
    tool_uses = [b for b in first.content if b.type == "tool_use"]
    system[0]["text"] = "x-anthropic-billing-header: cch=2;"
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": t.id, "content": "ok"} for t in tool_uses]},
    ]
    c.messages.create(model="m", max_tokens=500, system=system, messages=messages, tools=TOOLS,
                      thinking={"type": "adaptive"})
    before, after = engine.submitted[0].prompt_ids, engine.submitted[1].prompt_ids
    assert after[: len(before)] == before
