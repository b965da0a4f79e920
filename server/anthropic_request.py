"""Anthropic Messages API request bodies -> `ChatPrompt` + sampling settings.

Tolerant by design (see docs/CLIENTS.md): unknown fields, block types and `cache_control` are ignored;
Claude Code's per-request attribution line in `system[0]` is dropped so the prefix cache keeps hitting; images and
documents are replaced by a short placeholder (the model reads text only); server tools without `input_schema`
cannot run here and are dropped. `tool_choice` and structured output (`output_config.format`, or the older beta's
top-level `output_format`: `{"type": "json_schema", "schema": ...}`) become the answer's grammar
(`server.prompt.output_constraint`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server.anthropic_checks import check_messages_body
from server.errors import invalid_request
from server.prompt import ChatPrompt, append_user_note, tool_choice_note
from server.validation import (
    INT32_MAX,
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

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
DOCUMENT_PLACEHOLDER = "[document omitted: this model reads text only]"


@dataclasses.dataclass
class MessagesRequest:
    """A validated /v1/messages (or count_tokens) request."""

    model: str
    prompt: ChatPrompt
    max_tokens: int | None  # 0 = only prefill the prompt (warms the prefix cache), generate nothing
    stream: bool
    temperature: float
    top_p: float
    top_k: int
    stop_sequences: tuple[str, ...]
    show_thinking: bool


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """Validate and convert a Messages API body; `count_only` for count_tokens (no max_tokens/sampling)."""
    check_messages_body(body)
    model = get_str(body, "model", "")
    raw_messages = get_list(body, "messages")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for i, raw in enumerate(raw_messages):
        messages.extend(_convert_message(expect_dict(raw, f"messages.{i}"), f"messages.{i}"))

    if not raw_messages:
        raise invalid_request("messages: at least one message is required, got an empty array", "messages")
    prefill = ""
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        # A final assistant turn is a prefill: the answer continues it.
        prefill = messages.pop()["content"]
    if not any(m["role"] != "system" for m in messages):
        raise invalid_request("messages: the conversation has no user message: a final assistant message is a "
                              "prefill that the answer continues, so it needs a user message before it", "messages")

    tools, schemas = _convert_tools(get_list(body, "tools", []))
    choice = get_dict(body, "tool_choice") or {}
    choice_type = choice.get("type", "auto")
    if choice_type not in ("auto", "any", "tool", "none"):
        raise invalid_request(f"tool_choice.type: expected auto, any, tool or none, got {choice_type!r}",
                              "tool_choice")
    offered = bool(tools)
    if choice_type == "tool" and offered and choice.get("name") not in schemas:
        raise invalid_request(f"tool_choice.name: {choice.get('name')!r} is not one of the offered tools",
                              "tool_choice.name")
    if choice_type == "none":
        tools, schemas = [], {}
    note = tool_choice_note(choice_type, choice.get("name")) if tools else None
    if note:
        messages = append_user_note(messages, note)

    thinking = get_dict(body, "thinking") or {}
    thinking_on = thinking.get("type") in ("enabled", "adaptive")
    get_int(thinking, "budget_tokens", None, minimum=0, path="thinking.")  # read nowhere, but bounded like the rest
    output_schema = _output_schema(body)
    if output_schema is not None and prefill:
        raise invalid_request("output_config.format: a structured answer cannot continue a prefilled assistant "
                              "message", "output_config.format")
    prompt = ChatPrompt(
        messages=messages,
        tools=tools or None,
        tool_schemas=schemas,
        parse_tools=bool(tools),
        enable_thinking=thinking_on,
        prefill=prefill,
        tool_choice=_ENGINE_TOOL_CHOICE.get(choice_type, choice.get("name")) if offered else "auto",
        output_schema=output_schema,
    )
    if count_only:
        return MessagesRequest(model, prompt, None, False, 1.0, 1.0, 0, (), thinking_on)
    return MessagesRequest(
        model=model,
        prompt=prompt,
        max_tokens=get_int(body, "max_tokens", minimum=0, maximum=INT32_MAX),
        stream=get_bool(body, "stream", False),
        temperature=get_number(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=get_number(body, "top_p", 1.0, minimum=0.0, maximum=1.0),
        top_k=get_int(body, "top_k", 0, minimum=0, maximum=INT32_MAX),
        stop_sequences=get_stop_strings(body, "stop_sequences"),
        show_thinking=thinking_on,
    )


_ENGINE_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # "tool": the tool's name


def _output_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """Structured output's JSON schema: `output_config.format` (or the beta's top-level `output_format`), or None."""
    config = get_dict(body, "output_config") or {}
    where = "output_config.format"
    fmt = get_dict(config, "format", path="output_config.")
    if fmt is None:
        where, fmt = "output_format", get_dict(body, "output_format")
    if fmt is None:
        return None
    kind = get_str(fmt, "type", path=f"{where}.")
    if kind != "json_schema":
        raise invalid_request(f"{where}.type: expected json_schema, got {kind!r}", f"{where}.type")
    schema = get_dict(fmt, "schema", path=f"{where}.")
    if schema is None:
        raise invalid_request(f"{where}.schema: a JSON schema object is required", f"{where}.schema")
    check_tool_schema(schema, f"{where}.schema")
    return schema


def _system_text(system: Any) -> str:
    """`system` as one string: a string, or text blocks (minus Claude Code's attribution line)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise invalid_request("system: expected a string or a list of text blocks", "system")
    parts = []
    for i, block in enumerate(system):
        block = expect_dict(block, f"system.{i}")
        if block.get("type", "text") != "text":
            continue
        text = get_str(block, "text", path=f"system.{i}.")
        if text.startswith(BILLING_HEADER_PREFIX):
            continue  # changes every request; would defeat the prefix cache
        parts.append(text)
    return "\n".join(parts)


def _convert_message(message: dict[str, Any], path: str) -> list[dict[str, Any]]:
    role = message.get("role")
    content = message.get("content")
    if role not in ("user", "assistant", "system"):
        raise invalid_request(f"{path}.role: expected user, assistant or system, got {role!r}", f"{path}.role")
    if content is None:
        content = ""
    if not isinstance(content, (str, list)):
        raise invalid_request(f"{path}.content: expected a string or a list of content blocks", f"{path}.content")
    if role == "system":
        return [{"role": "system", "content": content if isinstance(content, str) else _text_of(content, path)}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "assistant":
        return [_assistant_message(content, path)]
    return _user_messages(content, path)


def _blocks(content: list[Any], path: str) -> list[tuple[int, dict[str, Any]]]:
    return [(j, expect_dict(block, f"{path}.content.{j}")) for j, block in enumerate(content)]


def _text_of(content: Any, path: str) -> str:
    """Plain text of a content value: a string, or blocks (text kept, images/documents as placeholders)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise invalid_request(f"{path}: expected a string or a list of content blocks", path)
    parts = []
    for j, block in _blocks(content, path):
        kind = block.get("type")
        if kind == "text":
            parts.append(get_str(block, "text", path=f"{path}.content.{j}."))
        elif kind == "image":
            parts.append(IMAGE_PLACEHOLDER)
        elif kind == "document":
            parts.append(DOCUMENT_PLACEHOLDER)
    return "\n".join(parts)


def _user_messages(content: list[Any], path: str) -> list[dict[str, Any]]:
    """A user turn: tool results become `tool` messages (first, as templates expect them right after the call),
    everything else one user message."""
    tool_messages, parts = [], []
    for j, block in _blocks(content, path):
        kind = block.get("type")
        where = f"{path}.content.{j}"
        if kind == "tool_result":
            result = _text_of(block.get("content"), f"{where}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            tool_messages.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result}
            )
        elif kind == "text":
            parts.append(get_str(block, "text", path=f"{where}."))
        elif kind == "image":
            parts.append(IMAGE_PLACEHOLDER)
        elif kind == "document":
            parts.append(DOCUMENT_PLACEHOLDER)
    messages = tool_messages
    if parts or not tool_messages:
        messages = messages + [{"role": "user", "content": "\n".join(parts)}]
    return messages


def _assistant_message(content: list[Any], path: str) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for j, block in _blocks(content, path):
        kind = block.get("type")
        where = f"{path}.content.{j}."
        if kind == "text":
            texts.append(get_str(block, "text", path=where))
        elif kind == "thinking":
            thinking.append(get_str(block, "thinking", "", path=where))
        elif kind == "tool_use":
            arguments = block.get("input")
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": get_str(block, "name", path=where),
                        "arguments": arguments if isinstance(arguments, dict) else {},
                    },
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _convert_tools(raw_tools: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Anthropic tools -> OpenAI-style function tools for the template, and name -> input_schema."""
    tools, schemas = [], {}
    for i, tool in enumerate(raw_tools):
        tool = expect_dict(tool, f"tools.{i}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            continue  # a server tool (web_search_20250305, ...): nothing local can run it
        name = get_str(tool, "name", path=f"tools.{i}.")
        check_tool_schema(schema, f"tools.{i}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
        schemas[name] = schema
    return tools, schemas
