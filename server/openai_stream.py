"""OpenAI chat-completion deltas from parser events, and the assembled message for non-streaming answers."""

from __future__ import annotations

from typing import Any

from server.anthropic_stream import random_id
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
        """The complete assistant message."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out
