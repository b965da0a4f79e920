"""Constrained decoding on the host: a request's `Constraint` (strata_jax/engine/protocol.py) as a grammar over the
model's tokens, and the per-request matcher that gives each step its token mask.

The grammar engine is llguidance (chosen by measurement, docs/PERF.md "Constrained decoding"): a Lark grammar with
inline JSON schemas, so one grammar says "free text, then tool calls in the chat template's own format, each naming
an offered tool, each argument following its schema". A `GrammarMatcher` lives on the host per request; before
each step it writes the packed mask of the tokens allowed next (int32 words, bit i of word w = token 32 w + i),
the step applies it to the logits, and the emitted tokens advance the matcher.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import llguidance
import numpy as np

from strata_jax.engine.protocol import Constraint, ToolSchema

QWEN_XML, JSON_CALLS = "qwen_xml", "json"
_ANY_TEXT = "/(?s:.*)/"
WS = "/[ \\t\\n]{0,4}/"  # whitespace between an answer's parts: ASCII, bounded (a weak model may not stop)


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed token mask."""
    return (vocab_size + 31) // 32


def full_mask(rows: int, vocab_size: int) -> np.ndarray:
    """Packed masks [rows, mask_words] allowing every token."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)


def unpack_mask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 masks [..., W] -> bool [..., vocab_size] (the reference of the step's unpacking)."""
    bits = (words[..., :, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(bool)


def _lit(text: str) -> str:
    return json.dumps(text)


def _schema(text: str | Mapping[str, Any]) -> dict[str, Any]:
    schema = json.loads(text) if isinstance(text, str) else dict(text)
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return schema


def _types(schema: Mapping[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


class _Lark:
    """Builds a Lark grammar's rules (names are unique; special tokens as `<name>` or as text)."""

    def __init__(self, special: frozenset[str]):
        self.special = special
        self.rules: list[str] = []
        self._n = 0

    def token(self, text: str) -> str:
        """A chat-format marker: the special token if the tokenizer has one of that name, else the text."""
        return text if text in self.special else _lit(text)

    def rule(self, body: str, stem: str = "r", options: str = "") -> str:
        self._n += 1
        name = f"{stem}_{self._n}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def json(self, schema: Mapping[str, Any]) -> str:
        # JSON laid out as json.dumps does, no free whitespace: a weak model left free whitespace can fill its whole
        # budget with blank lines inside a value that is never closed. Lenient: keywords llguidance does not implement
        # (Claude Code's tools use `propertyNames`) are ignored rather than failing the request.
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
        schema = {**schema, "x-guidance": {**layout, **schema.get("x-guidance", {})}}
        return self.rule("%json " + json.dumps(schema, separators=(",", ":")), "json")

    def text(self) -> str:
        return _ANY_TEXT


def _xml_value(lark: _Lark, schema: Mapping[str, Any]) -> str:
    """A Qwen XML parameter's value and its closing tag: strings are raw text (as the template renders them), every
    other type JSON following the schema."""
    close = "\n</parameter>\n"
    types = _types(schema)
    strings = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if strings is not None and all(isinstance(v, str) for v in strings) and strings:
        return "(" + " | ".join(_lit(v) for v in strings) + ") " + _lit(close)
    if types == {"string"} or (not types and not any(k in schema for k in ("anyOf", "oneOf", "enum", "const",
                                                                             "properties", "items"))):
        # The shortest text up to the closing tag: a value may contain anything else (a file's contents).
        return lark.rule("/(?s:.*)" + close.replace("/", "\\/").replace("\n", "\\n") + "/", "str", "[lazy]")
    return lark.json(schema) + " " + _lit(close)


def _xml_call(lark: _Lark, tool: ToolSchema) -> str:
    schema = _schema(tool.parameters)
    props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
    required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
    parts = [_lit(f"<function={tool.name}>\n")]
    for name, sub in props.items():
        value = _xml_value(lark, sub if isinstance(sub, Mapping) else {})
        param = lark.rule(f"{_lit(f'<parameter={name}>' + chr(10))} {value}", "param")
        parts.append(param if name in required else param + "?")
    if not props and schema.get("additionalProperties", True) is not False:
        free = lark.rule("/[A-Za-z_][A-Za-z0-9_.-]*/", "pname")
        parts.append(f"({_lit('<parameter=')} {free} {_lit('>' + chr(10))} {_xml_value(lark, {})})*")
    parts.append(_lit("</function>\n"))
    return lark.rule(" ".join(parts), "fn")


def _json_call(lark: _Lark, tool: ToolSchema) -> str:
    call = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": _schema(tool.parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}
    return lark.json(call) + ' "\\n"'


def lark_grammar(constraint: Constraint, special_tokens: Iterable[str] = (), tool_format: str = QWEN_XML) -> str:
    """The llguidance Lark grammar of `constraint`. `special_tokens`: the tokenizer's special tokens (chat markers
    such as `<tool_call>` are matched as those tokens when they are special, as text otherwise); `tool_format`:
    how the chat template writes a tool call (`QWEN_XML`: `<function=NAME>` and `<parameter=ARG>` blocks; `JSON_CALLS`:
    one `{"name", "arguments"}` object), see `tool_call_format`. Raises ValueError for a constraint that names no
    valid grammar."""
    lark = _Lark(frozenset(special_tokens))
    think_open, think_close = lark.token("<think>"), lark.token("</think>")
    if constraint.starts_in_thinking:
        prefix = lark.rule(f"{lark.text()} {think_close} {WS}", "think", "[lazy]" if think_close[0] == '"' else "")
    elif constraint.thinking:
        inner = lark.rule(f"{lark.text()} {think_close}", "thought", "[lazy]" if think_close[0] == '"' else "")
        prefix = lark.rule(f"({think_open} {inner} {WS})?", "think")
    else:
        prefix = ""
    if constraint.json_schema is not None:
        if constraint.tools:
            raise ValueError("a constraint is either a JSON schema or tool calls, not both")
        body = WS + " " + lark.json(_schema(constraint.json_schema))
    else:
        body = _tools_body(lark, constraint, tool_format)
    lines = ["%llguidance {}", f"start: {prefix} {body}".replace("  ", " ")] + lark.rules
    return "\n".join(lines) + "\n"


def _tools_body(lark: _Lark, constraint: Constraint, tool_format: str) -> str:
    choice = constraint.tool_choice
    names = [t.name for t in constraint.tools]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be distinct")
    if choice not in ("auto", "required", "none") and choice not in names:
        raise ValueError(f"tool_choice {choice!r} names no offered tool")
    open_, close = lark.token("<tool_call>"), lark.token("</tool_call>")
    if choice == "none" or not constraint.tools:
        if open_[0] == "<":  # a special token: plain text cannot produce it
            return lark.text()
        return lark.rule(f"{lark.text()} & ~/(?s:.*)<tool_call>(?s:.*)/", "TEXT".upper())
    tools = [t for t in constraint.tools if choice in ("auto", "required") or t.name == choice]
    build = _xml_call if tool_format == QWEN_XML else _json_call
    fns = " | ".join(build(lark, t) for t in tools)
    call = lark.rule(f"{open_} {_lit(chr(10))} ({fns}) {close}", "call")
    calls = f"{call} ({WS} {call})* {WS}"
    if choice != "auto":
        return WS + " " + calls
    if open_[0] == "<":
        return f"{lark.text()} ({calls})?"
    # The call marker is text: free text up to the first marker, then calls only.
    head = lark.rule(f"{lark.text()} {open_}", "head", "[lazy]")
    call_after = lark.rule(f"{_lit(chr(10))} ({fns}) {close}", "call")
    return f"({head} {call_after} ({WS} {call})* {WS} | {lark.text()})"


def tool_call_format(tokenizer) -> str:
    """How the tokenizer's chat template writes a tool call: rendered once with a probe call."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "probe_tool", "arguments": {"probe_arg": 1}}}]}],
            tools=[{"type": "function", "function": {"name": "probe_tool", "parameters": {
                "type": "object", "properties": {"probe_arg": {"type": "integer"}}}}}],
            tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render tools: JSON calls are the common default
        return JSON_CALLS
    return QWEN_XML if "<function=probe_tool>" in text else JSON_CALLS


class GrammarMatcher:
    """One request's grammar state on the host: the mask of the next token, advanced by each emitted token."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill(self, row: np.ndarray) -> None:
        """Writes the packed mask of the tokens allowed next into `row` (int32 [mask_words], C-contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, tokens: Iterable[int]) -> bool:
        """Consumes emitted tokens; False if one was not allowed (the matcher then stops constraining)."""
        return all(self._m.consume_token(int(t)) for t in tokens)

    def fill_window(self, drafts: list[int], out: np.ndarray) -> int:
        """Masks for a verify window (`out` [1 + len(drafts), mask_words]): the next token's, then after each draft
        the grammar allows, the one after it; the matcher is left as it was. Returns how many drafts the grammar
        allows (the window is cut there: a draft it forbids cannot be accepted)."""
        self.fill(out[0])
        allowed = 0
        for i, token in enumerate(drafts):
            if not self._m.try_consume_tokens([int(token)]):
                break
            allowed += 1
            self.fill(out[i + 1])
        self.rollback(allowed)
        return allowed

    def rollback(self, n: int) -> None:
        """Forgets the last `n` consumed tokens (drafts the target model rejected)."""
        if n:
            self._m.rollback(n)

    @property
    def failed(self) -> str | None:
        """Why the matcher stopped (a token it did not allow), or None."""
        return self._m.get_error() if self._m.is_error() else None


class ConstraintCompiler:
    """Compiles constraints for one tokenizer (its token bytes, special tokens and tool-call format)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        """`tokenizer`: a `strata_jax.tokenizer.Tokenizer`; `vocab_size`: the model's (masks cover it, tokens past
        the tokenizer's are never allowed); `eos_ids`: the tokens that end an answer."""
        self.vocab_size = vocab_size
        eos = sorted(int(t) for t in eos_ids)
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._special = frozenset(tokenizer.id_to_token(i) for i in tokenizer.special_token_ids)
        self.tool_format = tool_call_format(tokenizer)

    @functools.lru_cache(maxsize=64)  # agents send the same tools every turn: compile their grammar once
    def grammar(self, constraint: Constraint) -> str:
        """The Lark grammar of `constraint`, checked by llguidance; ValueError if it is not valid."""
        grammar = llguidance.LLMatcher.grammar_from_lark(lark_grammar(constraint, self._special, self.tool_format))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(f"the constraint's grammar is not valid: {'; '.join(messages)}")
        return grammar

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for one request; ValueError for a constraint that cannot be compiled."""
        matcher = llguidance.LLMatcher(self._tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be compiled: {matcher.get_error()}")
        return GrammarMatcher(matcher)
