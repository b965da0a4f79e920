"""From API-neutral chat messages to prompt token ids, through the checkpoint's own chat template.

Both APIs convert their request into a `ChatPrompt` (OpenAI-style messages with string contents, which is what
chat templates expect); this module folds stray system messages, renders, tokenizes and checks the context.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

import jinja2

from strata_jax.engine.protocol import Constraint, ToolSchema
from strata_jax.tokenizer import Tokenizer, TooManyTokens

from server.errors import ApiError, invalid_request

log = logging.getLogger("strata.server")

REMINDER_OPEN, REMINDER_CLOSE = "<system-reminder>\n", "\n</system-reminder>"


@dataclasses.dataclass
class ChatPrompt:
    """A conversation ready for the chat template.

    messages: dicts with role system/user/assistant/tool and string `content` (assistant: optional `tool_calls`
    `[{"id", "type": "function", "function": {"name", "arguments": dict}}]` and `reasoning_content`; tool:
    `tool_call_id`). `tools`: OpenAI-style function tools for the template (None = no tools). `tool_schemas`: name ->
    JSON input schema, for typing parsed tool-call arguments. `prefill`: assistant text the answer continues from.
    `tool_choice`: "auto", "required", "none" (tools were offered but may not be called) or a tool's name;
    `output_schema`: the JSON schema the answer must follow (OpenAI `response_format`, Anthropic
    `output_config.format`), or None. Both only shape the answer through `output_constraint`.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_schemas: dict[str, Any] = dataclasses.field(default_factory=dict)
    parse_tools: bool = True
    enable_thinking: bool | None = None
    prefill: str = ""
    tool_choice: str = "auto"
    output_schema: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    """The rendered prompt: text, token ids, whether generation starts inside an opened `<think>`, and whether the
    answer may open one (not when the template already closed an empty block, as it does with thinking off, nor
    after a prefill)."""

    text: str
    ids: list[int]
    start_in_thinking: bool
    may_open_thinking: bool = True


def reminder(text: str) -> str:
    """`text` wrapped as a `<system-reminder>` (how Claude Code itself marks system notes inside user turns)."""
    return REMINDER_OPEN + text + REMINDER_CLOSE


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Leading system messages become one first system message; later ones are folded into a neighbouring user
    turn as `<system-reminder>` text, because chat templates reject a system message anywhere but first.

    A later system message is appended to the user turn right before it (keeping the order, and keeping earlier
    turns' rendering unchanged as the conversation grows, which the prefix cache needs); otherwise it is prepended
    to the next user turn after any tool results; otherwise it becomes a user turn of its own.
    """
    out: list[dict[str, Any]] = []
    i = 0
    system_parts = []
    while i < len(messages) and messages[i]["role"] == "system":
        system_parts.append(messages[i]["content"])
        i += 1
    if system_parts:
        out.append({"role": "system", "content": "\n\n".join(p for p in system_parts if p)})
    pending: list[str] = []  # reminders waiting for the next user turn
    for message in messages[i:]:
        role = message["role"]
        if role == "system":
            note = reminder(message["content"])
            if out and out[-1]["role"] == "user" and not pending:
                out[-1] = {**out[-1], "content": _join(out[-1]["content"], note)}
            else:
                pending.append(note)
            continue
        if pending and role == "user":
            message = {**message, "content": _join("\n\n".join(pending), message["content"])}
            pending = []
        elif pending and role != "tool":
            out.append({"role": "user", "content": "\n\n".join(pending)})
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def merge_consecutive_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns (and consecutive assistant turns) combined into one, as Anthropic's API does."""
    out: list[dict[str, Any]] = []
    for message in messages:
        prev = out[-1] if out else None
        if prev is None or message["role"] != prev["role"] or message["role"] not in ("user", "assistant"):
            out.append(message)
            continue
        merged = {**prev, "content": _join(prev["content"], message["content"])}
        if message["role"] == "assistant":
            if message.get("reasoning_content"):
                merged["reasoning_content"] = _join(prev.get("reasoning_content", ""), message["reasoning_content"])
            if message.get("tool_calls"):
                merged["tool_calls"] = list(prev.get("tool_calls") or []) + list(message["tool_calls"])
        out[-1] = merged
    return out


def append_user_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """`note` added at the end of the conversation: to the last user turn, or as a new user turn."""
    if messages and messages[-1]["role"] == "user":
        return messages[:-1] + [{**messages[-1], "content": _join(messages[-1]["content"], note)}]
    return messages + [{"role": "user", "content": note}]


def _join(first: str, second: str) -> str:
    return f"{first}\n\n{second}" if first and second else first or second


def tool_choice_note(choice: str, name: str | None = None) -> str | None:
    """The instruction that enforces a tool choice the template cannot express: "any" or a named tool."""
    if choice == "any":
        return reminder("You must answer with a call to one of the available tools.")
    if choice == "tool" and name:
        return reminder(f"You must answer with a call to the tool `{name}`.")
    return None


def render_prompt(tokenizer: Tokenizer, prompt: ChatPrompt, max_prompt_tokens: int | None = None) -> RenderedPrompt:
    """Render `prompt` with the chat template and tokenize it; template errors become 400s. Tokenizing runs in
    pieces (a caller's thread leaves the event loop responsive); with `max_prompt_tokens` (what the context can take)
    a longer prompt is a 400 in Anthropic's "prompt is too long" form, counted exactly up to twice the limit and no
    further (a megabytes-long prompt costs no more than that)."""
    messages = merge_consecutive_turns(fold_system_messages(prompt.messages))
    if not messages:
        raise invalid_request("messages: at least one message is required", "messages")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=prompt.tools or None,
            add_generation_prompt=True,
            enable_thinking=prompt.enable_thinking,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - the template runs on client data: what it raises is a bad request
        if not isinstance(exc, (jinja2.TemplateError, TypeError, ValueError, KeyError)):
            log.warning("chat template failed on a request (%s: %s); answered 400", type(exc).__name__, exc)
        raise invalid_request("the conversation cannot be rendered with the model's chat template: "
                              f"{_short(f'{type(exc).__name__}: {exc}')}") from exc
    if not isinstance(text, str):
        raise invalid_request("the model's chat template did not render text")
    start_in_thinking = text.rstrip().endswith("<think>")
    may_open_thinking = not start_in_thinking and not text.rstrip().endswith("</think>") and not prompt.prefill
    if prompt.prefill:
        text += prompt.prefill
        if "</think>" in prompt.prefill:
            start_in_thinking = False
        elif "<think>" in prompt.prefill:
            start_in_thinking = True
    try:
        stop_after = None if max_prompt_tokens is None else 2 * max_prompt_tokens
        ids = tokenizer.encode_in_pieces(text, stop_after=stop_after)
    except TooManyTokens as exc:
        count = f"{exc.count}" if exc.exact else f"more than {exc.count}"
        raise invalid_request(f"prompt is too long: {count} tokens > {max_prompt_tokens} maximum") from exc
    except (TypeError, ValueError) as exc:  # e.g. text the tokenizer cannot take (validation should stop it first)
        raise invalid_request(f"the prompt cannot be tokenized: {_short(str(exc))}") from exc
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise invalid_request(f"prompt is too long: {len(ids)} tokens > {max_prompt_tokens} maximum")
    return RenderedPrompt(text=text, ids=ids, start_in_thinking=start_in_thinking,
                          may_open_thinking=may_open_thinking)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def engine_top_k(top_k: int, vocab_size: int) -> int:
    """`top_k` as the engine should get it: a k of at least the vocabulary size keeps every token, i.e. is off (0);
    so the engine never sees a k larger than its vocabulary."""
    return 0 if top_k >= vocab_size else top_k


def prompt_too_long(prompt_tokens: int, context_length: int) -> ApiError:
    """The 400 clients recognise for a context overflow."""
    return invalid_request(f"prompt is too long: {prompt_tokens} tokens > {context_length - 1} maximum")


def clamp_max_tokens(requested: int | None, prompt_tokens: int, context_length: int) -> int:
    """`requested` (None = as many as fit) limited to the context left; 400 when the prompt leaves no room."""
    room = context_length - prompt_tokens
    if room < 1:
        raise prompt_too_long(prompt_tokens, context_length)
    return room if requested is None else min(requested, room)


def tool_schema_map(tools: list[Mapping[str, Any]] | None) -> dict[str, Any]:
    """name -> parameters schema of OpenAI-style function tools."""
    out: dict[str, Any] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def output_constraint(prompt: ChatPrompt, rendered: RenderedPrompt, *, constrain_tools: bool = True
                      ) -> Constraint | None:
    """The grammar the answer must follow (the engine masks every step with it), or None for a free answer.

    Offered tools (with `constrain_tools`, serve's default): calls name only those tools, arguments follow their
    schemas, `tool_choice` holds (a forced choice: calls only; "none": no call). Else the output schema, if any:
    the answer is one JSON value following it. Offered tools win over an output schema (one grammar cannot yet say
    "JSON or tool calls"); with tools offered and `constrain_tools` off, the answer is free. A `<think>` block stays
    possible where the rendered prompt allows one."""
    thinking = {"thinking": rendered.may_open_thinking, "starts_in_thinking": rendered.start_in_thinking}
    if prompt.tools:
        if not constrain_tools:
            return None
        tools = tuple(ToolSchema(name, json.dumps(schema)) for name, schema in tool_schema_map(prompt.tools).items())
        return Constraint(tools=tools, tool_choice=prompt.tool_choice, **thinking)
    if prompt.output_schema is not None:
        return Constraint(json_schema=json.dumps(prompt.output_schema), **thinking)
    if prompt.tool_choice == "none" and constrain_tools:
        return Constraint(tool_choice="none", **thinking)
    return None
