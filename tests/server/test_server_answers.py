"""What an answer says beyond its text, through the official SDKs: `n` other than 1 is a clear 400, `content` is
never null when the budget went to reasoning, prefix-cache hits are reported in both APIs' usage, and the engine
slot shows in the request's log line and in the live monitor."""

import json
import logging
import time

import anthropic
import openai
import pytest
from server_helpers import httpx

from server.logs import JsonFormatter

USER = [{"role": "user", "content": "hi"}]
THINKING = "<think>\nLet me think about this carefully, at length, step by step.\n</think>\n\nThe answer."
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_n_other_than_one_is_a_clear_400(serve):
    server, engine = serve()
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).chat.completions.create(model="m", messages=USER, n=2)
    assert info.value.body == {"message": "n: only n=1 is supported", "type": "invalid_request_error", "param": "n",
                               "code": None}
    assert openai_client(server).chat.completions.create(model="m", messages=USER, n=1).choices[0].index == 0
    assert len(engine.submitted) == 1


def test_budget_spent_thinking_gives_empty_content_and_the_reasoning(serve):
    server, _ = serve(THINKING)
    out = openai_client(server).chat.completions.create(model="m", messages=USER, max_tokens=8)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.content == "" and message.reasoning_content.startswith("Let me")
    content, reasoning, finish = None, "", None
    for chunk in openai_client(server).chat.completions.create(model="m", messages=USER, max_tokens=8, stream=True):
        delta = chunk.choices[0].delta
        if delta.content is not None:
            content = (content or "") + delta.content
        reasoning += getattr(delta, "reasoning_content", None) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and reasoning == message.reasoning_content and finish == "length"
    out = openai_client(server).chat.completions.create(model="m", messages=USER)  # the whole answer
    assert out.choices[0].message.content == "The answer." and out.choices[0].finish_reason == "stop"


def test_content_is_null_only_beside_tool_calls(serve):
    server, _ = serve(CALL)
    out = openai_client(server).chat.completions.create(model="m", messages=USER, tools=[TOOL])
    assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_cached_tokens_in_both_apis_usage(serve, tokenizer):
    server, engine = serve(cached_tokens=5)
    out = openai_client(server).chat.completions.create(model="m", messages=USER)
    n_prompt = len(engine.submitted[-1].prompt_ids)
    assert out.usage.prompt_tokens == n_prompt and out.usage.prompt_tokens_details.cached_tokens == 5
    usage = None
    for chunk in openai_client(server).chat.completions.create(model="m", messages=USER, stream=True,
                                                               stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens == 5
    message = anthropic_client(server).messages.create(model="m", max_tokens=50, messages=USER)
    n_prompt = len(engine.submitted[-1].prompt_ids)
    assert message.usage.cache_read_input_tokens == 5 and message.usage.input_tokens == n_prompt - 5
    assert message.usage.cache_creation_input_tokens == 0
    with anthropic_client(server).messages.stream(model="m", max_tokens=50, messages=USER) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == 5 and final.usage.input_tokens == n_prompt - 5


def test_slot_in_the_log_line_and_the_monitor(serve):
    server, _ = serve(slot=3)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("strata.requests")
    handler, old_level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        openai_client(server).completions.create(model="m", prompt="hi", max_tokens=4)
        deadline = time.monotonic() + 10
        while not records and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["slot"] == 3 and line["api"] == "completions" and line["message"].endswith(", slot 3")
    assert line["stop"] == "length" and line["output_tokens"] == 4
    monitor = httpx.get(server.url + "/v1/monitor", timeout=10).json()
    assert monitor["recent"]["last"][-1]["slot"] == 3
