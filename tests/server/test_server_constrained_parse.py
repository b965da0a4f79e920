"""The tool-call parser reads exactly what the engine's tool-call grammar lets the model write: each answer below is
first checked against the grammar itself (llguidance, with the demo tokenizer: every token allowed, the end of turn
allowed after it), then parsed, and the calls must come out with the arguments written, valid for their schemas."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from server.prompt import ChatPrompt, RenderedPrompt, output_constraint
from server.toolcalls import OutputParser, TextDelta, ThinkingDelta, ToolCallEnd, ToolCallStart, grammar_writes_raw
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine.constraints import ConstraintCompiler, mask_words, unpack_mask
from strata_jax.engine.protocol import Constraint
from strata_jax.tokenizer import load_tokenizer

SCHEMAS = {
    "write_file": {"type": "object", "properties": {
        "path": {"type": "string"},
        "content": {"type": "string"},
        "mode": {"type": "string", "enum": ["create", "append"]},
        "note": {"type": ["string", "null"]},
        "tag": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "kind": {"const": "text"},
        "meta": {"type": "object", "properties": {"lines": {"type": "integer"}}},
        "extra": {"description": "anything"},
    }, "required": ["path", "content"]},
    "run_command": {"type": "object", "properties": {
        "command": {"type": "string"},
        "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
        "env": {"type": "array", "items": {"type": "string"}},
        "dry": {"type": "boolean"},
        "ratio": {"type": "number"},
    }, "required": ["command"]},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]


def _call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (answer as the grammar writes it, the calls it holds: [(name, arguments)], the text before them)
CASES = [
    (_call("run_command", ("command", "ls -la"), ("timeout", "30")), [("run_command", {"command": "ls -la",
                                                                                      "timeout": 30})], ""),
    # A written file may hold the parameter and call markup as text: only "\n</parameter>\n" ends a value.
    (_call("write_file", ("path", "a.py"),
           ("content", 'END = "</parameter>"\nx = "</function>\n"\n\n'),
           ("mode", "append")),
     [("write_file", {"path": "a.py", "content": 'END = "</parameter>"\nx = "</function>\n"\n\n',
                      "mode": "append"})], ""),
    # Empty and newline-edged strings keep exactly their text.
    (_call("write_file", ("path", "\nb.txt"), ("content", "")),
     [("write_file", {"path": "\nb.txt", "content": ""})], ""),
    # Values whose schema is not plain text are JSON: a quoted string, null, an object, a const.
    (_call("write_file", ("path", "c"), ("content", "x"), ("note", '"null"'), ("tag", '"7"'), ("kind", '"text"'),
           ("meta", '{"lines": 3}'), ("extra", "{\"k\": [1, 2]}")),
     [("write_file", {"path": "c", "content": "x", "note": "null", "tag": "7", "kind": "text", "meta": {"lines": 3},
                      "extra": {"k": [1, 2]}})], ""),
    (_call("write_file", ("path", "d"), ("content", "y"), ("note", "null"), ("tag", "7")),
     [("write_file", {"path": "d", "content": "y", "note": None, "tag": 7})], ""),
    # Text before the calls may mention markup (the grammar's free text) without it becoming a call.
    ("I will use <function=search_code> later.\n" + _call("run_command", ("command", "make"), ("env", '["A=1"]'),
                                                           ("dry", "false"), ("ratio", "0.5"))
     + "\n" + _call("run_command", ("command", "make test")),
     [("run_command", {"command": "make", "env": ["A=1"], "dry": False, "ratio": 0.5}),
      ("run_command", {"command": "make test"})], "I will use <function=search_code> later."),
]


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer(DEMO_MODEL)
    vocab = json.loads((DEMO_MODEL / "config.json").read_text())["vocab_size"]
    return tokenizer, ConstraintCompiler(tokenizer, vocab, tokenizer.eos_token_ids)


def _grammar_accepts(compiler, constraint: Constraint, text: str) -> bool:
    tokenizer, comp = compiler
    matcher = comp.matcher(constraint)
    if not matcher.advance(tokenizer.encode(text)):
        return False
    row = np.zeros(mask_words(comp.vocab_size), np.int32)
    matcher.fill(row)
    allowed = unpack_mask(row, comp.vocab_size)
    return any(allowed[t] for t in tokenizer.eos_token_ids)


def _parse(text: str, constrained: bool = True, pieces: int = 7):
    """Parsed (calls, text, thinking), the text fed in small pieces as a stream would bring it."""
    parser = OutputParser(SCHEMAS, constrained=constrained)
    events = []
    for i in range(0, len(text), pieces):
        events += parser.feed(text[i:i + pieces])
    events += parser.finish()
    calls, name = [], None
    for ev in events:
        if isinstance(ev, ToolCallStart):
            name = ev.name
        elif isinstance(ev, ToolCallEnd):
            calls.append((name, ev.arguments))
    shown = "".join(ev.text for ev in events if isinstance(ev, TextDelta))
    thought = "".join(ev.text for ev in events if isinstance(ev, ThinkingDelta))
    return calls, shown, thought


def _constraint(tool_choice="auto", thinking=False):
    prompt = ChatPrompt(messages=[], tools=TOOLS, tool_schemas=SCHEMAS, tool_choice=tool_choice)
    return output_constraint(prompt, RenderedPrompt("", [], False, may_open_thinking=thinking))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parser_reads_what_the_grammar_writes(compiler, case):
    text, expected, before = CASES[case]
    assert _grammar_accepts(compiler, _constraint(), text)
    for pieces in (1, 7, len(text)):
        calls, shown, _ = _parse(text, pieces=pieces)
        assert calls == expected and shown == before
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])


def test_grammar_refuses_what_the_parser_would_not_read(compiler):
    # A made-up tool, a missing required argument, a non-JSON value for a typed parameter.
    for text in (_call("search_code", ("query", "x")), _call("run_command", ("timeout", "3")),
                 _call("run_command", ("command", "ls"), ("env", "A=1"))):
        assert not _grammar_accepts(compiler, _constraint(), text)
    # Forced choices: calls only (no text first), the named tool only; "none": no call at all.
    call = _call("run_command", ("command", "ls"))
    assert _grammar_accepts(compiler, _constraint("required"), call)
    assert not _grammar_accepts(compiler, _constraint("required"), "Sure.\n" + call)
    assert not _grammar_accepts(compiler, _constraint("write_file"), call)
    none = output_constraint(ChatPrompt(messages=[], tool_choice="none"), RenderedPrompt("", [], False))
    assert none == Constraint(tool_choice="none", thinking=True)
    assert not _grammar_accepts(compiler, none, call) and _grammar_accepts(compiler, none, "No call.")


def test_thinking_before_the_calls(compiler):
    text = "<think>\nplan: run it\n</think>\n\n" + _call("run_command", ("command", "ls"))
    assert _grammar_accepts(compiler, _constraint(thinking=True), text)
    assert not _grammar_accepts(compiler, _constraint(thinking=False), text)
    assert _parse(text) == ([("run_command", {"command": "ls"})], "", "plan: run it")


def test_unconstrained_parser_keeps_its_tolerance():
    # Without a grammar, a call without its <tool_call> wrapper still counts, and a value ends at </parameter>.
    text = "<function=run_command>\n<parameter=command>\nls</parameter>\n</function>"
    assert _parse(text, constrained=False)[0] == [("run_command", {"command": "ls"})]
    assert _parse(text)[0] == []  # constrained: the grammar never writes this; it is text


def test_raw_or_json_matches_the_engine_rule():
    from strata_jax.engine.constraints import _xml_value, _Lark

    for schema in [{"type": "string"}, {"enum": ["a", "b"]}, {"type": ["string", "null"]}, {"const": "x"},
                   {"anyOf": [{"type": "string"}]}, {}, {"description": "d"}, {"type": "integer"},
                   {"type": "string", "enum": ["a"]}, {"items": {}}, "not a schema"]:
        lark = _Lark(frozenset())
        value = _xml_value(lark, schema if isinstance(schema, dict) else {})
        engine_raw = not any("%json" in rule for rule in lark.rules) and "%json" not in value
        assert grammar_writes_raw(schema) == engine_raw, schema
