"""OpenAI chat completions through the official `openai` SDK against a real server (ScriptedEngine seam)."""

import json

import openai
import pytest
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer, httpx, parse_sse

from server.app import create_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
                "required": ["city"],
            },
        },
    }
]
CALL_OUTPUT = (
    "<think>\nNeed the weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
    "</parameter>\n</function>\n</tool_call>"
)
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture
def serve(tokenizer):
    servers = []

    def start(script="Hello from strata.", **kwargs):
        engine = ScriptedEngine(tokenizer, script, context_length=kwargs.pop("context_length", 4096))
        app = create_app(engine, tokenizer, served_name="strata-demo", api_key=kwargs.pop("api_key", None),
                         context_length=engine.context_length, **kwargs)
        server = ServerThread(app)
        servers.append(server)
        return server, engine

    yield start
    for server in servers:
        server.stop()


def client(server, api_key="unused"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


def test_completion_text_and_usage(serve):
    server, engine = serve()
    out = client(server).chat.completions.create(model="any", messages=USER, temperature=0, seed=7)
    choice = out.choices[0]
    assert choice.message.content == "Hello from strata." and choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert out.usage.prompt_tokens == len(engine.submitted[0].prompt_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert engine.submitted[0].sampling.seed == 7 and engine.submitted[0].sampling.temperature == 0


def test_streaming_with_tools(serve):
    server, _ = serve(CALL_OUTPUT)
    stream = client(server).chat.completions.create(model="any", messages=USER, tools=TOOLS, stream=True,
                                                    stream_options={"include_usage": True})
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and reasoning == "Need the weather."
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3, "metric": True}
    assert usage is not None and usage.completion_tokens > 0


def test_non_streaming_tool_call_and_history(serve):
    server, engine = serve(CALL_OUTPUT)
    c = client(server)
    out = c.chat.completions.create(model="any", messages=USER, tools=TOOLS)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments)["days"] == 3
    # send the call and its result back, OpenAI style
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": msg.tool_calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": msg.tool_calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21C"},
        {"role": "system", "content": "Be brief."},
    ]
    c.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=5)
    prompt = engine.prompt_text()
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    assert "<system-reminder>\nBe brief.\n</system-reminder>" in prompt
    assert engine.submitted[-1].sampling.max_tokens == 5


def test_tool_choice_and_stop(serve):
    server, engine = serve("alpha beta gamma delta")
    c = client(server)
    c.chat.completions.create(model="any", messages=USER, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in engine.prompt_text()
    c.chat.completions.create(model="any", messages=USER, tools=TOOLS, tool_choice="required")
    assert "You must answer with a call" in engine.prompt_text()
    out = c.chat.completions.create(model="any", messages=USER, stop=["gamma"])
    assert out.choices[0].message.content == "alpha beta" and out.choices[0].finish_reason == "stop"
    out = c.chat.completions.create(model="any", messages=USER, max_completion_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_models_in_openai_shape(serve):
    server, _ = serve()
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["strata-demo"] and models.data[0].object == "model"
    assert client(server).models.retrieve("strata-demo").owned_by == "strata_jax"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-9")


def test_errors_in_openai_shape(serve):
    server, _ = serve(api_key="k", context_length=64)
    with pytest.raises(openai.AuthenticationError) as info:
        client(server, "bad").chat.completions.create(model="any", messages=USER)
    assert info.value.body["type"] == "authentication_error"
    good = client(server, "k")
    with pytest.raises(openai.BadRequestError) as info:
        good.chat.completions.create(model="any", messages=[{"role": "user", "content": "word " * 100}])
    assert "prompt is too long" in info.value.message
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{oops", headers={"authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "x"}, headers={"authorization": "Bearer k"})
    assert r.status_code == 400 and "messages: expected an array" in r.json()["error"]["message"]
    assert r.headers["request-id"].startswith("req_")


def test_raw_stream_ends_with_done(serve):
    server, _ = serve()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": USER, "stream": True})
    frames = parse_sse(r.text)
    assert frames[-1] == (None, "[DONE]")
    chunks = [data for _, data in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_loading_is_503_for_openai_clients(tokenizer):
    server = ServerThread(create_app(None, None, served_name="x", api_key=None, context_length=0))
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client(server).chat.completions.create(model="any", messages=USER)
        assert info.value.status_code == 503
    finally:
        server.stop()
