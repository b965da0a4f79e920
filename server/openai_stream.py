"""OpenAI chat-completion deltas from parser events, and the assembled message for non-streaming answers."""

from __future__ import annotations

from typing import Any

from strata_jax.engine.protocol import TokenEvent
from strata_jax.tokenizer import Tokenizer

from server.anthropic_stream import random_id
from server.logprobs import chat_entry, token_text
from server.toolcalls import ParseEvent, TextDelta, ThinkingDelta, ToolCallDelta, ToolCallEnd, ToolCallStart


class ChoiceBuilder:
    """Accumulates one choice; `apply` returns the `delta` objects to stream (reasoning as `reasoning_content`,
    the vLLM/DeepSeek convention)."""

    def __init__(self) -> None:
        """An empty assistant message."""
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []

    def apply(self, events: list[ParseEvent]) -> list[dict[str, Any]]:
        """Consume parser events; return the deltas they produce."""
        deltas: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                self.content += ev.text
                deltas.append({"content": ev.text})
            elif isinstance(ev, ThinkingDelta):
                self.reasoning += ev.text
                deltas.append({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCallStart):
                call = {"id": random_id("call_"), "type": "function", "function": {"name": ev.name, "arguments": ""}}
                self.tool_calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self.tool_calls) - 1, **call,
                                               "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ToolCallDelta) and self.tool_calls and ev.partial_json:
                self.tool_calls[-1]["function"]["arguments"] += ev.partial_json
                deltas.append({"tool_calls": [{"index": len(self.tool_calls) - 1,
                                               "function": {"arguments": ev.partial_json}}]})
            elif isinstance(ev, ToolCallEnd):
                pass  # the streamed argument pieces already form the JSON
        return deltas

    def message(self) -> dict[str, Any]:
        """The complete assistant message. `content` is a string, "" when the whole budget went to reasoning; null
        only beside tool calls with no text (as OpenAI's API answers)."""
        out: dict[str, Any] = {"role": "assistant",
                               "content": None if self.tool_calls and not self.content else self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ChatLogprobs:
    """`choices[].logprobs` of a chat completion: the tokens' entries gathered by `add` until a chunk (or the final
    answer) `take`s them. Every generated token is listed, reasoning and tool-call markup included; the end-of-turn
    token is not (its text is not shown either)."""

    def __init__(self, tokenizer: Tokenizer, top: int | None, eos_ids: frozenset[int]) -> None:
        """`top`: the request's top_logprobs (None: logprobs were not asked for)."""
        self._texts = token_text(tokenizer) if top is not None else None
        self._top = top or 0
        self._eos_ids = eos_ids
        self._pending: list[dict[str, Any]] = []

    def add(self, event: TokenEvent) -> None:
        """Gather the entries of one engine event's tokens."""
        if self._texts is None:
            return
        for entry in event.logprobs:
            if event.finish_reason is not None and entry.token_id in self._eos_ids:
                continue
            self._pending.append(chat_entry(entry, self._texts, self._top))

    def take(self, *, always: bool = False) -> dict[str, Any] | None:
        """`{"content": [...], "refusal": None}` with the gathered entries (then forgotten); None when logprobs
        were not asked for, or when nothing was gathered unless `always`."""
        if self._texts is None or not (self._pending or always):
            return None
        out, self._pending = self._pending, []
        return {"content": out, "refusal": None}
