"""Incremental parser of model output text: reasoning, plain text and tool calls.

Feed it the text deltas of one generated turn; it returns events as soon as they are certain:

- `<think>...</think>` becomes `ThinkingDelta`s closed by a `ThinkingEnd`;
- Qwen3-Coder XML tool calls

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE
      </parameter>
      </function>
      </tool_call>

  (also without the `<tool_call>` wrapper, which Qwen3-Coder sometimes drops) and the JSON variant
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` become `ToolCallStart(name)`, `ToolCallDelta`s whose
  `partial_json` pieces concatenate to the JSON arguments object, and `ToolCallEnd(arguments)`;
- everything else is `TextDelta`s.

A partial tag at the end of a delta is held back until the next delta decides it. Parameter values are converted to
the JSON types the tool's `input_schema` declares (string parameters stream as they arrive; other types are converted
once complete). Whitespace at the edges of a text or reasoning run (e.g. the blank line after `</think>` or between
text and a tool call) is dropped. Malformed tool-call markup before the function name is known is passed through as
text; after it, the call is closed as well as possible.

`constrained=True` is for output that follows the engine's tool-call grammar (`strata_jax/engine/constraints.py`,
`_xml_value` and `_xml_call`), which is stricter than a free model: a call opens only at `<tool_call>` and names an
offered tool (anything else is text), a value ends only at its exact closing `\n</parameter>\n` (so a written file
may contain `</parameter>` or `</function>`), and a value whose schema is not plain text is JSON (`"a"` for a
`["string", "null"]` parameter is the string a).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "OutputParser",
    "ParseEvent",
    "TextDelta",
    "ThinkingDelta",
    "ThinkingEnd",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "convert_value",
    "schema_types",
]


@dataclasses.dataclass(frozen=True)
class TextDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ThinkingEnd:
    pass


@dataclasses.dataclass(frozen=True)
class ToolCallStart:
    name: str


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    partial_json: str


@dataclasses.dataclass(frozen=True)
class ToolCallEnd:
    arguments: dict[str, Any]


ParseEvent = TextDelta | ThinkingDelta | ThinkingEnd | ToolCallStart | ToolCallDelta | ToolCallEnd

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# What ends a parameter value: its closing tag, or the end of the call when the model forgets that tag. (Values may
# legitimately contain other markup, e.g. a file written with the Write tool, so nothing looser ends them.)
_VALUE_ENDS = (PARAM_CLOSE, FUNC_CLOSE + "\n" + CALL_CLOSE)
_MAX_NAME = 256  # a function/parameter name longer than this is not a name
GRAMMAR_VALUE_END = "\n" + PARAM_CLOSE + "\n"  # how the grammar closes every value
_SCHEMA_SHAPE_KEYS = ("anyOf", "oneOf", "enum", "const", "properties", "items")

# Parser states.
_TEXT, _THINK, _CALL, _FUNC_NAME, _FUNC_BODY, _PARAM_NAME, _PARAM_VALUE, _FUNC_END, _JSON = range(9)


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a (sub)schema allows: from `type`, `anyOf`/`oneOf`, `enum`/`const`; empty = unknown."""
    if not isinstance(schema, Mapping):
        return frozenset()
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset({kind})
    if isinstance(kind, list):
        return frozenset(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: set[str] = set()
            for sub in schema[key]:
                sub_types = schema_types(sub)
                if not sub_types:
                    return frozenset()
                out |= sub_types
            return frozenset(out)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values:
        return frozenset(_json_type(v) for v in values)
    if "properties" in schema:
        return frozenset({"object"})
    if "items" in schema:
        return frozenset({"array"})
    return frozenset()


def grammar_writes_raw(schema: Any) -> bool:
    """Whether the engine's tool-call grammar writes a parameter of this schema as raw text (strings, string enums,
    untyped values) rather than JSON; the same rule as `strata_jax.engine.constraints._xml_value`."""
    schema = schema if isinstance(schema, Mapping) else {}
    kind = schema.get("type")
    if isinstance(kind, str):
        types = {kind}
    else:
        types = {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return True
    return types == {"string"} or (not types and not any(k in schema for k in _SCHEMA_SHAPE_KEYS))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _parse_structured(text: str) -> Any:
    """JSON, or a Python literal (models sometimes write `{'a': 1}`); raises ValueError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError) as exc:
        raise ValueError(str(exc)) from exc


_INT_RE = re.compile(r"[-+]?\d+")


def convert_value(raw: str, types: frozenset[str]) -> Any:
    """Converts the raw text of a parameter to the JSON value its schema `types` ask for.

    Tried in a fixed order (null, integer, number, boolean, object/array); string when the schema allows a string
    and nothing else matched, or when no conversion works (the tool then reports the bad value itself). Unknown
    types (empty set): JSON if the text parses as JSON, else the string.
    """
    text = raw.strip()
    if not types:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return raw
    if "null" in types and text in ("null", "None"):
        return None
    if "integer" in types:
        if _INT_RE.fullmatch(text):
            return int(text)
        try:
            number = float(text)
            if number.is_integer() and "number" not in types:
                return int(number)
        except ValueError:
            pass
    if "number" in types:
        if _INT_RE.fullmatch(text):
            return int(text)
        try:
            number = float(text)
            if math.isfinite(number):
                return number
        except ValueError:
            pass
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"object", "array"}:
        try:
            value = _parse_structured(text)
            if ("object" in types and isinstance(value, dict)) or ("array" in types and isinstance(value, list)):
                return value
        except ValueError:
            pass
    return raw


def _partial_suffix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `tags` (to hold back)."""
    best = 0
    for tag in tags:
        for k in range(min(len(buf), len(tag) - 1), best, -1):
            if tag.startswith(buf[-k:]):
                best = k
                break
    return best


def _find_first(buf: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(index, tag) of the earliest tag in `buf`, or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = buf.find(tag)
        if i != -1 and (best == -1 or i < best):
            best, found = i, tag
    return best, found


class OutputParser:
    """Incremental parser of one generated turn. See the module docstring.

    `tools` maps tool names to their JSON `input_schema` (used for value types); `parse_tools=False` leaves tool-call
    markup as text. `start_in_thinking` is for prompts whose generation prompt already opened `<think>`.
    `constrained`: the output follows the engine's tool-call grammar (see the module docstring).
    """

    def __init__(self, tools: Mapping[str, Any] | None = None, *, parse_tools: bool = True,
                 start_in_thinking: bool = False, constrained: bool = False) -> None:
        """Create a parser; see the class docstring (and the module's for `constrained`)."""
        self._tools = dict(tools or {})
        self._parse_tools = parse_tools
        self._constrained = constrained
        self._value_ends = (GRAMMAR_VALUE_END,) if constrained else _VALUE_ENDS
        self._json_value = False  # the current value is JSON (constrained: its schema is not plain text)
        self._buf = ""
        self._out: list[ParseEvent] = []
        self._state = _THINK if start_in_thinking else _TEXT
        # Whitespace at the end of the current text/thinking run, emitted only if more content follows.
        self._pending_ws = ""
        self._run_started = False  # the current text/thinking run has emitted content (else: strip leading ws)
        self._raw = ""  # markup consumed since a tool call began, replayed as text if it turns out malformed
        self._schema_props: Mapping[str, Any] = {}
        self._args: dict[str, Any] = {}
        self._args_open = False  # the arguments object's "{" has been emitted
        self._saved_run = ("", False)  # text-run state before a tool-call tag, restored if it is not a call
        self._param = ""
        self._param_types: frozenset[str] = frozenset()
        self._streaming_value = False
        self._value = ""
        self._value_lead_checked = False
        self._json = ""
        self.tool_calls = 0  # completed tool calls so far

    # ------------------------------------------------------------------------------------------------- public API

    def feed(self, text: str) -> list[ParseEvent]:
        """Consume a text delta; return the events it makes certain."""
        self._buf += text
        while self._step(final=False):
            pass
        return self._drain()

    def finish(self) -> list[ParseEvent]:
        """End of the output: flush held-back text and close an open reasoning block or tool call."""
        while self._step(final=True):
            pass
        state = self._state
        if state == _TEXT:
            self._text(self._buf)
        elif state == _THINK:
            self._thinking(self._buf)
            self._out.append(ThinkingEnd())
        elif state in (_CALL, _FUNC_NAME):
            self._fallback_to_text()
            self._text(self._buf)
        elif state == _JSON:
            if not self._finish_json(self._json + self._buf):
                self._fallback_to_text()
                self._text(self._buf)
        else:  # inside a started call: close it with what we have
            if state == _PARAM_VALUE:
                piece = self._buf
                self._finish_value(piece[:-1] if piece.endswith("\n") else piece)
            self._end_call()
        self._buf = ""
        self._state = _TEXT
        return self._drain()

    # ------------------------------------------------------------------------------------------------- emission

    def _drain(self) -> list[ParseEvent]:
        out, self._out = self._merge(self._out), []
        return out

    @staticmethod
    def _merge(events: list[ParseEvent]) -> list[ParseEvent]:
        merged: list[ParseEvent] = []
        for ev in events:
            prev = merged[-1] if merged else None
            if type(ev) is type(prev) and isinstance(ev, (TextDelta, ThinkingDelta)):
                merged[-1] = type(ev)(prev.text + ev.text)  # type: ignore[union-attr]
            elif isinstance(ev, ToolCallDelta) and isinstance(prev, ToolCallDelta):
                merged[-1] = ToolCallDelta(prev.partial_json + ev.partial_json)
            else:
                merged.append(ev)
        return merged

    def _run_text(self, text: str, kind: type[TextDelta] | type[ThinkingDelta]) -> None:
        """Emit run content, holding back trailing whitespace and dropping leading whitespace of the run."""
        if not self._run_started:
            text = text.lstrip()
        if not text:
            return
        text = self._pending_ws + text
        core = text.rstrip()
        self._pending_ws = text[len(core):]
        if core:
            self._out.append(kind(core))
            self._run_started = True

    def _text(self, text: str) -> None:
        self._run_text(text, TextDelta)

    def _thinking(self, text: str) -> None:
        self._run_text(text, ThinkingDelta)

    def _new_run(self) -> None:
        self._pending_ws, self._run_started = "", False

    def _args_json(self, piece: str) -> None:
        self._out.append(ToolCallDelta(piece))

    # ------------------------------------------------------------------------------------------------- states

    def _step(self, final: bool) -> bool:
        """Advance the state machine over the buffer; False when it needs more input."""
        state = self._state
        if state == _TEXT:
            return self._step_text(final)
        if state == _THINK:
            return self._step_think(final)
        if state == _CALL:
            return self._step_call(final)
        if state == _FUNC_NAME:
            return self._step_func_name(final)
        if state == _FUNC_BODY:
            return self._step_func_body(final)
        if state == _PARAM_NAME:
            return self._step_param_name(final)
        if state == _PARAM_VALUE:
            return self._step_param_value(final)
        if state == _FUNC_END:
            return self._step_func_end(final)
        return self._step_json(final)

    def _text_tags(self) -> tuple[str, ...]:
        tags = (THINK_OPEN, THINK_CLOSE)
        if not self._parse_tools:
            return tags
        return tags + ((CALL_OPEN,) if self._constrained else (CALL_OPEN, FUNC_OPEN))

    def _step_text(self, final: bool) -> bool:
        tags = self._text_tags()
        i, tag = _find_first(self._buf, tags)
        if i == -1:
            hold = 0 if final else _partial_suffix(self._buf, tags)
            self._text(self._buf[: len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            return False
        self._text(self._buf[:i])
        self._buf = self._buf[i + len(tag):]
        if tag == THINK_OPEN:
            self._new_run()
            self._state = _THINK
        elif tag == THINK_CLOSE:
            # A stray close tag (the template opened <think> in the prompt): drop the tag, keep going as text.
            self._new_run()
        else:
            self._saved_run = (self._pending_ws, self._run_started)
            self._new_run()
            self._raw = tag
            self._state = _CALL if tag == CALL_OPEN else _FUNC_NAME
        return True

    def _step_think(self, final: bool) -> bool:
        i = self._buf.find(THINK_CLOSE)
        if i == -1:
            hold = 0 if final else _partial_suffix(self._buf, (THINK_CLOSE,))
            self._thinking(self._buf[: len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            return False
        self._thinking(self._buf[:i])
        self._out.append(ThinkingEnd())
        self._buf = self._buf[i + len(THINK_CLOSE):]
        self._new_run()
        self._state = _TEXT
        return True

    def _fallback_to_text(self) -> None:
        """The markup after a tool-call tag is not a call: replay what was consumed as text, as if never held."""
        self._pending_ws, self._run_started = self._saved_run
        raw, self._raw = self._raw, ""
        self._text(raw)
        self._state = _TEXT

    def _step_call(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        self._raw += self._buf[: len(self._buf) - len(stripped)]
        self._buf = stripped
        if stripped.startswith(FUNC_OPEN):
            self._raw += FUNC_OPEN
            self._buf = stripped[len(FUNC_OPEN):]
            self._state = _FUNC_NAME
            return True
        if stripped.startswith("{"):
            self._json = ""
            self._state = _JSON
            return True
        if not final and FUNC_OPEN.startswith(stripped):  # empty or a partial `<function=`
            return False
        self._fallback_to_text()
        return True

    def _step_func_name(self, final: bool) -> bool:
        i = self._buf.find(">")
        head = self._buf if i == -1 else self._buf[:i]
        if "\n" in head or "<" in head or len(head) > _MAX_NAME or (i == -1 and final):
            self._fallback_to_text()
            return True
        if i == -1:
            return False
        name = head.strip()
        if not name or (self._constrained and name not in self._tools):
            self._fallback_to_text()
            return True
        self._buf = self._buf[i + 1:]
        self._raw = ""
        schema = self._tools.get(name)
        props = schema.get("properties") if isinstance(schema, Mapping) else None
        self._schema_props = props if isinstance(props, Mapping) else {}
        self._args = {}
        self._args_open = False
        self._out.append(ToolCallStart(name))
        self._state = _FUNC_BODY
        return True

    def _step_func_body(self, final: bool) -> bool:
        self._buf = self._buf.lstrip()
        buf = self._buf
        for tag, state in ((PARAM_OPEN, _PARAM_NAME), (FUNC_CLOSE, _FUNC_END), (CALL_CLOSE, _TEXT)):
            if buf.startswith(tag):
                self._buf = buf[len(tag):]
                if state == _TEXT:  # `</tool_call>` without `</function>`
                    self._end_call()
                else:
                    self._state = state
                return True
        if not buf:
            return False
        if not final and any(tag.startswith(buf) for tag in (PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE)):
            return False
        # Stray text between parameters: skip to the next tag.
        j = buf.find("<", 1)
        self._buf = buf[j:] if j != -1 else ""
        return bool(self._buf)

    def _step_param_name(self, final: bool) -> bool:
        i = self._buf.find(">")
        if i == -1:
            if final or len(self._buf) > _MAX_NAME:
                self._buf = ""
                self._state = _FUNC_BODY
                return True
            return False
        self._param = self._buf[:i].strip()
        self._buf = self._buf[i + 1:]
        schema = self._schema_props.get(self._param)
        self._param_types = schema_types(schema)
        self._json_value = self._constrained and not grammar_writes_raw(schema)
        self._streaming_value = self._param_types == {"string"} and not self._json_value
        self._value = ""
        self._value_lead_checked = False
        if self._streaming_value:
            self._args_json(self._open_key() + '"')
        self._state = _PARAM_VALUE
        return True

    def _open_key(self) -> str:
        """JSON text that opens the current parameter's key: `{"name": ` or `, "name": `."""
        prefix = ", " if self._args_open else "{"
        self._args_open = True
        return prefix + json.dumps(self._param, ensure_ascii=False) + ": "

    def _step_param_value(self, final: bool) -> bool:
        if not self._value_lead_checked:
            if not self._buf and not final:
                return False
            if self._buf.startswith("\n"):
                self._buf = self._buf[1:]
            self._value_lead_checked = True
        ends = self._value_ends
        i, tag = _find_first(self._buf, ends)
        if i == -1:
            if final:
                return False  # finish() closes the value
            hold = _partial_suffix(self._buf, ends + tuple("\n" + t for t in ends))
            if self._buf.endswith("\n"):
                hold = max(hold, 1)
            self._take_value(self._buf[: len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            return False
        value = self._buf[:i]
        self._buf = self._buf[i + len(tag):] if tag in (PARAM_CLOSE, GRAMMAR_VALUE_END) else self._buf[i:]
        self._finish_value(value[:-1] if value.endswith("\n") and tag != GRAMMAR_VALUE_END else value)
        self._state = _FUNC_BODY
        return True

    def _take_value(self, piece: str) -> None:
        if not piece:
            return
        self._value += piece
        if self._streaming_value:
            self._args_json(json.dumps(piece, ensure_ascii=False)[1:-1])

    def _finish_value(self, last_piece: str) -> None:
        self._take_value(last_piece)
        if self._streaming_value:
            value: Any = self._value
            self._args_json('"')
        else:
            value = self._json_or_converted(self._value)
            self._args_json(self._open_key() + json.dumps(value, ensure_ascii=False))
        self._args[self._param] = value

    def _json_or_converted(self, text: str) -> Any:
        if self._json_value:
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass  # a value cut short (max_tokens) or written after the grammar gave up: convert as usual
        return convert_value(text, self._param_types)

    def _end_call(self) -> None:
        self._args_json("}" if self._args_open else "{}")
        self._out.append(ToolCallEnd(dict(self._args)))
        self._args_open = False
        self.tool_calls += 1
        self._new_run()
        self._state = _TEXT

    def _step_func_end(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(CALL_CLOSE):
            self._buf = stripped[len(CALL_CLOSE):]
            self._end_call()
            return True
        if not final and CALL_CLOSE.startswith(stripped):  # empty or a partial `</tool_call>`
            return False
        self._end_call()  # no closing `</tool_call>`: the call is still complete
        return True

    def _step_json(self, final: bool) -> bool:
        i = self._buf.find(CALL_CLOSE)
        if i == -1:
            if final:
                return False
            hold = _partial_suffix(self._buf, (CALL_CLOSE,))
            self._json += self._buf[: len(self._buf) - hold]
            self._raw += self._buf[: len(self._buf) - hold]
            self._buf = self._buf[len(self._buf) - hold:]
            return False
        body = self._json + self._buf[:i]
        self._raw += self._buf[: i + len(CALL_CLOSE)]
        self._buf = self._buf[i + len(CALL_CLOSE):]
        if not self._finish_json(body):
            self._fallback_to_text()
        return True

    def _finish_json(self, body: str) -> bool:
        """Emit a complete JSON-variant call; False if `body` is not one."""
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
            return False
        if self._constrained and obj["name"].strip() not in self._tools:
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return False
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return False
        self._raw = ""
        self._out.append(ToolCallStart(obj["name"].strip()))
        self._out.append(ToolCallDelta(json.dumps(args, ensure_ascii=False)))
        self._out.append(ToolCallEnd(args))
        self.tool_calls += 1
        self._new_run()
        self._state = _TEXT
        return True
