"""OpenAI chat-completions request bodies -> `ChatPrompt` + sampling settings.

Same tolerance as the Anthropic side: unknown fields are ignored, image/audio/file parts become a placeholder.
Reasoning can be switched with vLLM's `chat_template_kwargs: {"enable_thinking": bool}` or `reasoning_effort`.
`tool_choice` and `response_format` (`json_object`: any JSON object; `json_schema`: its schema, enforced whether or
not `strict`; `text`: free) become the answer's grammar (`server.prompt.output_constraint`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from strata_jax.engine.protocol import MAX_TOP_LOGPROBS

from server.anthropic_request import IMAGE_PLACEHOLDER
from server.errors import invalid_request
from server.prompt import ChatPrompt, append_user_note, tool_choice_note
from server.validation import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    check_tool_schema,
    expect_dict,
    get_bool,
    get_dict,
    get_int,
    get_list,
    get_number,
    get_stop_strings,
    get_str,
)

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclasses.dataclass
class ChatRequest:
    """A validated /v1/chat/completions request."""

    model: str
    prompt: ChatPrompt
    max_tokens: int | None
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    logprobs: int | None = None  # None: none asked; k: each token's logprob and its k most likely alternatives


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate and convert a chat-completions body."""
    model = get_str(body, "model", "")
    messages = [_convert_message(expect_dict(m, f"messages.{i}"), f"messages.{i}")
                for i, m in enumerate(get_list(body, "messages"))]
    if get_int(body, "n", 1, minimum=1, maximum=INT32_MAX) != 1:
        raise invalid_request("n: only n=1 is supported", "n")

    tools, schemas = _convert_tools(get_list(body, "tools", []))
    choice = body.get("tool_choice", "auto")
    forced: str | None = None
    if isinstance(choice, dict):
        forced = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        choice = "tool"
    if choice not in ("auto", "none", "required", "tool"):
        raise invalid_request("tool_choice: expected none, auto, required or a function", "tool_choice")
    offered = bool(tools)
    if choice == "tool" and offered and forced not in schemas:
        raise invalid_request(f"tool_choice.function.name: {forced!r} is not one of the offered tools",
                              "tool_choice.function.name")
    if choice == "none":
        tools, schemas = [], {}
    note = tool_choice_note("any" if choice == "required" else choice, forced) if tools else None
    if note:
        messages = append_user_note(messages, note)

    kwargs = get_dict(body, "chat_template_kwargs") or {}
    enable_thinking = kwargs.get("enable_thinking")
    if not isinstance(enable_thinking, bool):
        effort = body.get("reasoning_effort")
        enable_thinking = None if effort is None else effort not in ("none", "minimal")

    max_tokens = get_int(body, "max_completion_tokens", None, minimum=1, maximum=INT32_MAX)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, minimum=1, maximum=INT32_MAX)
    stream_options = get_dict(body, "stream_options") or {}
    return ChatRequest(
        model=model,
        prompt=ChatPrompt(messages=messages, tools=tools or None, tool_schemas=schemas, parse_tools=bool(tools),
                          enable_thinking=enable_thinking,
                          tool_choice=(forced if choice == "tool" else choice) if offered else "auto",
                          output_schema=response_schema(body)),
        max_tokens=max_tokens,
        stream=get_bool(body, "stream", False),
        include_usage=bool(stream_options.get("include_usage")),
        temperature=get_number(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=get_number(body, "top_p", 1.0, minimum=0.0, maximum=1.0),
        top_k=max(get_int(body, "top_k", 0, minimum=-1, maximum=INT32_MAX), 0),  # vLLM's -1 = off, like 0
        seed=get_int(body, "seed", None, minimum=INT64_MIN, maximum=INT64_MAX),
        stop=get_stop_strings(body, "stop"),
        logprobs=chat_logprobs(body),
    )


def response_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """`response_format` as the JSON schema the answer must follow: json_object -> any object, json_schema -> its
    `schema` (any object when it has none), text or absent -> None."""
    fmt = get_dict(body, "response_format")
    if fmt is None:
        return None
    kind = get_str(fmt, "type", path="response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise invalid_request(f"response_format.type: expected text, json_object or json_schema, got {kind!r}",
                              "response_format.type")
    spec = get_dict(fmt, "json_schema", path="response_format.")
    if spec is None:
        raise invalid_request("response_format.json_schema: required for type json_schema",
                              "response_format.json_schema")
    get_bool(spec, "strict", False, path="response_format.json_schema.")
    schema = get_dict(spec, "schema", path="response_format.json_schema.")
    if schema is None:
        return {"type": "object"}
    check_tool_schema(schema, "response_format.json_schema.schema")
    return schema


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """`logprobs: true` + `top_logprobs: k` as the engine's `SamplingParams.logprobs` (None when not asked)."""
    top = get_int(body, "top_logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if not get_bool(body, "logprobs", False):
        if top:
            raise invalid_request("top_logprobs: needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _content_text(content: Any, path: str) -> str:
    """A message content: a string, null, or a list of parts (text kept, media as a placeholder)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{path}.content: expected a string or a list of content parts", f"{path}.content")
    parts = []
    for j, part in enumerate(content):
        part = expect_dict(part, f"{path}.content.{j}")
        kind = part.get("type")
        if kind == "text":
            parts.append(get_str(part, "text", path=f"{path}.content.{j}."))
        elif kind in ("image_url", "input_audio", "file", "image"):
            parts.append(IMAGE_PLACEHOLDER if "image" in kind else f"[{kind} omitted: this model reads text only]")
    return "\n".join(parts)


def _convert_message(message: dict[str, Any], path: str) -> dict[str, Any]:
    role = message.get("role")
    if role not in _ROLES:
        raise invalid_request(f"{path}.role: unknown role {role!r}", f"{path}.role")
    content = _content_text(message.get("content"), path)
    if role in ("system", "developer"):
        return {"role": "system", "content": content}
    if role in ("tool", "function"):
        return {"role": "tool", "tool_call_id": str(message.get("tool_call_id", "")), "content": content}
    if role == "user":
        return {"role": "user", "content": content}
    out: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    calls = []
    for j, call in enumerate(get_list(message, "tool_calls", [], path=f"{path}.")):
        where = f"{path}.tool_calls.{j}"
        call = expect_dict(call, where)
        fn = expect_dict(call.get("function"), f"{where}.function")
        calls.append({
            "id": str(call.get("id", "")),
            "type": "function",
            "function": {"name": get_str(fn, "name", path=f"{where}.function."),
                         "arguments": _arguments(fn.get("arguments"), f"{where}.function.arguments")},
        })
    if calls:
        out["tool_calls"] = calls
    return out


def _arguments(raw: Any, path: str) -> dict[str, Any]:
    """Tool-call arguments arrive as a JSON string; templates want the object."""
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        raise invalid_request(f"{path}: expected a JSON string", path)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"{path}: not valid JSON: {exc}", path) from exc
    return value if isinstance(value, dict) else {"value": value}


def _convert_tools(raw_tools: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tools, schemas = [], {}
    for i, tool in enumerate(raw_tools):
        tool = expect_dict(tool, f"tools.{i}")
        if tool.get("type", "function") != "function":
            continue
        fn = expect_dict(tool.get("function"), f"tools.{i}.function")
        name = get_str(fn, "name", path=f"tools.{i}.function.")
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {"type": "object",
                                                                                     "properties": {}}
        check_tool_schema(params, f"tools.{i}.function.parameters")
        function: dict[str, Any] = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            function["description"] = fn["description"]
        tools.append({"type": "function", "function": function})
        schemas[name] = params
    return tools, schemas
