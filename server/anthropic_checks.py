"""Type checks of an Anthropic Messages request body, before it is converted (`server.anthropic_request`).

Every field this server reads, and every field of the known content block types, must have the type Anthropic's
API documents, else a 400 `invalid_request_error` naming the field: `stop_sequences` a list of strings (not a
string), `metadata.user_id` a string, `system` a string or text blocks, `tool_choice` and `thinking` objects with a
string `type` (and `tool_choice.name` for `{"type": "tool"}`), each block's `type` a string, `tool_use.input` an
object, `tool_result.is_error` a boolean, `cache_control` an object... Missing optional fields stay optional, and
unknown fields and unknown block types are still ignored (docs/CLIENTS.md: Claude Code keeps adding them).
Numbers (`max_tokens`, `temperature`, `top_p`, `top_k`, `thinking.budget_tokens`) and `stream` are checked where
they are read.
"""

from __future__ import annotations

from typing import Any

from server.body import type_name
from server.errors import invalid_request
from server.validation import expect_dict, get_bool, get_dict, get_list, get_str

# Known block types: (field, check, required). Checks: "str", "object", "bool".
_BLOCK_FIELDS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "text": (("text", "str", True),),
    "image": (("source", "object", False),),
    "document": (("source", "object", False), ("title", "str", False), ("context", "str", False)),
    "tool_use": (("id", "str", True), ("name", "str", True), ("input", "object", False)),
    "tool_result": (("tool_use_id", "str", True), ("is_error", "bool", False)),
    "thinking": (("thinking", "str", True), ("signature", "str", False)),
    "redacted_thinking": (("data", "str", True),),
}


def check_messages_body(body: dict[str, Any]) -> None:
    """400 for the first field of `body` whose type is wrong (see the module docstring)."""
    stops = get_list(body, "stop_sequences", None)
    if stops is not None:
        for i, stop in enumerate(stops):
            if not isinstance(stop, str):
                raise invalid_request(f"stop_sequences.{i}: expected a string, got {type_name(stop)}",
                                      f"stop_sequences.{i}")
    metadata = get_dict(body, "metadata")
    if metadata is not None:
        get_str(metadata, "user_id", None, path="metadata.")
    _check_system(body.get("system"))
    _check_tool_choice(get_dict(body, "tool_choice"))
    thinking = get_dict(body, "thinking")
    if thinking is not None:
        get_str(thinking, "type", path="thinking.")
    for i, tool in enumerate(get_list(body, "tools", None) or []):
        _check_tool(expect_dict(tool, f"tools.{i}"), f"tools.{i}.")
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            _check_blocks(message["content"], f"messages.{i}.content")


def _check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise invalid_request(f"system: expected a string or a list of text blocks, got {type_name(system)}",
                              "system")
    for i, block in enumerate(system):
        block = expect_dict(block, f"system.{i}")
        kind = get_str(block, "type", "text", path=f"system.{i}.")
        _check_block_fields(block, kind, f"system.{i}.")


def _check_tool_choice(choice: dict[str, Any] | None) -> None:
    if choice is None:
        return
    kind = get_str(choice, "type", path="tool_choice.")
    if kind == "tool":
        get_str(choice, "name", path="tool_choice.")
    else:
        get_str(choice, "name", None, path="tool_choice.")
    get_bool(choice, "disable_parallel_tool_use", False, path="tool_choice.")


def _check_tool(tool: dict[str, Any], where: str) -> None:
    get_str(tool, "type", None, path=where)
    get_str(tool, "name", None, path=where)
    get_str(tool, "description", None, path=where)
    get_dict(tool, "input_schema", path=where)
    get_dict(tool, "cache_control", path=where)


def _check_blocks(blocks: list[Any], where: str) -> None:
    for j, block in enumerate(blocks):
        path = f"{where}.{j}"
        block = expect_dict(block, path)
        kind = get_str(block, "type", path=f"{path}.")
        _check_block_fields(block, kind, f"{path}.")
        if kind == "tool_result":
            content = block.get("content")
            if isinstance(content, list):
                _check_blocks(content, f"{path}.content")
            elif content is not None and not isinstance(content, str):
                raise invalid_request(f"{path}.content: expected a string or a list of content blocks, got "
                                      f"{type_name(content)}", f"{path}.content")


def _check_block_fields(block: dict[str, Any], kind: str, path: str) -> None:
    get_dict(block, "cache_control", path=path)
    for field, check, required in _BLOCK_FIELDS.get(kind, ()):
        if check == "str" and required:
            get_str(block, field, path=path)
        elif check == "str":
            get_str(block, field, None, path=path)
        elif check == "object":
            get_dict(block, field, path=path)
        else:
            get_bool(block, field, False, path=path)
