"""Anthropic response content from parser events: SSE block events while streaming, the content list at the end.

Blocks are opened lazily and closed in index order, so every block gets exactly one `content_block_start`, its
deltas, and one `content_block_stop`; thinking blocks get a `signature_delta` right before their stop.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import string
from typing import Any

from server.toolcalls import (
    ParseEvent,
    TextDelta,
    ThinkingDelta,
    ThinkingEnd,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)

_ID_ALPHABET = string.ascii_letters + string.digits

SseEvent = tuple[str, dict[str, Any]]


def random_id(prefix: str, length: int = 24) -> str:
    """`prefix` + random [A-Za-z0-9] (tool ids must match ^[a-zA-Z0-9_-]+$)."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def thinking_signature(thinking: str) -> str:
    """A non-empty signature for a thinking block. Clients only echo it back; nothing here verifies it."""
    return base64.b64encode(b"strata:" + hashlib.sha256(thinking.encode()).digest()).decode()


class MessageBuilder:
    """Turns parser events into Anthropic content blocks (and their SSE events)."""

    def __init__(self, *, show_thinking: bool) -> None:
        """`show_thinking=False` drops reasoning (the request did not ask for extended thinking)."""
        self._show_thinking = show_thinking
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # type of the block being built, if open
        self._json_parts: list[str] = []

    @property
    def has_tool_use(self) -> bool:
        """Whether any tool_use block was produced."""
        return any(block["type"] == "tool_use" for block in self.content)

    def apply(self, events: list[ParseEvent]) -> list[SseEvent]:
        """Consume parser events; return the SSE events they produce."""
        out: list[SseEvent] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                self._ensure_open("text", out)
                self.content[-1]["text"] += ev.text
                out.append(self._delta({"type": "text_delta", "text": ev.text}))
            elif isinstance(ev, ThinkingDelta):
                if not self._show_thinking:
                    continue
                self._ensure_open("thinking", out)
                self.content[-1]["thinking"] += ev.text
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif isinstance(ev, ThinkingEnd):
                if self._open == "thinking":
                    self._close(out)
            elif isinstance(ev, ToolCallStart):
                self._close(out)
                block = {"type": "tool_use", "id": random_id("toolu_"), "name": ev.name, "input": {}}
                self._start(block, out)
            elif isinstance(ev, ToolCallDelta):
                if self._open == "tool_use" and ev.partial_json:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": ev.partial_json}))
            elif isinstance(ev, ToolCallEnd) and self._open == "tool_use":
                self.content[-1]["input"] = ev.arguments
                self._close(out)
        return out

    def finish(self) -> list[SseEvent]:
        """Close the open block, if any."""
        out: list[SseEvent] = []
        self._close(out)
        return out

    def _ensure_open(self, kind: str, out: list[SseEvent]) -> None:
        if self._open == kind:
            return
        self._close(out)
        block: dict[str, Any] = {"type": "text", "text": ""} if kind == "text" else {
            "type": "thinking", "thinking": "", "signature": ""}
        self._start(block, out)

    def _start(self, block: dict[str, Any], out: list[SseEvent]) -> None:
        self.content.append(block)
        self._open = block["type"]
        start = dict(block)
        if block["type"] == "tool_use":
            start["input"] = {}
        out.append(("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                            "content_block": start}))

    def _delta(self, delta: dict[str, Any]) -> SseEvent:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self, out: list[SseEvent]) -> None:
        if self._open is None:
            return
        block = self.content[-1]
        if self._open == "thinking":
            block["signature"] = thinking_signature(block["thinking"])
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1}))
        self._open = None
