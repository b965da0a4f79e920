"""The incremental output parser (server/toolcalls.py): text, <think>, Qwen3-Coder XML and JSON tool calls, fed in
every possible split so held-back partial tags are exercised."""

import json

import pytest

from server.toolcalls import (
    OutputParser,
    TextDelta,
    ThinkingDelta,
    ThinkingEnd,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    convert_value,
    schema_types,
)

TOOLS = {
    "Write": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["file_path", "content"],
    },
    "Read": {
        "type": "object",
        "properties": {
            "file_path": {"type": "string"},
            "offset": {"type": "integer"},
            "limit": {"type": "integer"},
        },
    },
    "Mixed": {
        "type": "object",
        "properties": {
            "timeout": {"type": "number"},
            "flag": {"type": "boolean"},
            "meta": {"type": "object"},
            "items": {"type": "array", "items": {"type": "string"}},
            "maybe": {"type": ["string", "null"]},
            "status": {"anyOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "null"}]},
            "mode": {"enum": [1, 2, 3]},
            "anything": {"description": "no type"},
        },
    },
}


def xml_call(name, params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text, chunks=None, **kw):
    """Parse `text` fed in the given chunks (default: whole); return merged events."""
    parser = OutputParser(TOOLS, **kw)
    events = []
    for piece in chunks if chunks is not None else [text]:
        events += parser.feed(piece)
    events += parser.finish()
    return OutputParser._merge(events)


def summarize(events):
    """Events as comparable tuples, checking that each tool call's deltas form the JSON of its arguments."""
    out, pieces = [], None
    for ev in events:
        if isinstance(ev, ToolCallStart):
            assert pieces is None
            pieces = []
            out.append(("call", ev.name))
        elif isinstance(ev, ToolCallDelta):
            assert pieces is not None
            pieces.append(ev.partial_json)
        elif isinstance(ev, ToolCallEnd):
            assert json.loads("".join(pieces)) == ev.arguments, "".join(pieces)
            out.append(("args", ev.arguments))
            pieces = None
        elif isinstance(ev, TextDelta):
            out.append(("text", ev.text))
        elif isinstance(ev, ThinkingDelta):
            out.append(("thinking", ev.text))
        else:
            assert isinstance(ev, ThinkingEnd)
            out.append(("end_thinking",))
    assert pieces is None, "tool call left open"
    return _merge_tuples(out)


def _merge_tuples(items):
    merged = []
    for item in items:
        if merged and item[0] in ("text", "thinking") and merged[-1][0] == item[0]:
            merged[-1] = (item[0], merged[-1][1] + item[1])
        else:
            merged.append(item)
    return merged


CASES = {
    "plain": (
        "Hello, world! a < b and x<y, <b>bold</b> <tool <think \n\nbye\n",
        [("text", "Hello, world! a < b and x<y, <b>bold</b> <tool <think \n\nbye")],
    ),
    "thinking": (
        "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.",
        [("thinking", "Step 1.\nStep 2."), ("end_thinking",), ("text", "The answer is 4.")],
    ),
    "write_call": (
        "I'll create it.\n\n"
        + xml_call("Write", [("file_path", "/tmp/x.py"), ("content", 'def f():\n    return "ok" \\ é\n\n')]),
        [
            ("text", "I'll create it."),
            ("call", "Write"),
            ("args", {"file_path": "/tmp/x.py", "content": 'def f():\n    return "ok" \\ é\n\n'}),
        ],
    ),
    "typed_values": (
        xml_call(
            "Mixed",
            [
                ("timeout", "2.5"),
                ("flag", "True"),
                ("meta", '{"k": [1, 2], "s": "v"}'),
                ("items", "['a', 'b']"),
                ("maybe", "null"),
                ("status", "a"),
                ("mode", "2"),
                ("anything", "[1, 2]"),
                ("unknown_param", "plain words"),
            ],
        ),
        [
            ("call", "Mixed"),
            (
                "args",
                {
                    "timeout": 2.5,
                    "flag": True,
                    "meta": {"k": [1, 2], "s": "v"},
                    "items": ["a", "b"],
                    "maybe": None,
                    "status": "a",
                    "mode": 2,
                    "anything": [1, 2],
                    "unknown_param": "plain words",
                },
            ),
        ],
    ),
    "two_calls_then_text": (
        xml_call("Read", [("file_path", "a.txt"), ("offset", "10")])
        + "\n"
        + xml_call("Read", [("file_path", "b.txt"), ("limit", "5")])
        + "\n\nDone.",
        [
            ("call", "Read"),
            ("args", {"file_path": "a.txt", "offset": 10}),
            ("call", "Read"),
            ("args", {"file_path": "b.txt", "limit": 5}),
            ("text", "Done."),
        ],
    ),
    "no_wrapper": (
        "<function=Read>\n<parameter=file_path>\nz.md\n</parameter>\n</function>",
        [("call", "Read"), ("args", {"file_path": "z.md"})],
    ),
    "json_variant": (
        'Let me look.\n<tool_call>\n{"name": "Read", "arguments": {"file_path": "q.py", "offset": 3}}\n</tool_call>',
        [("text", "Let me look."), ("call", "Read"), ("args", {"file_path": "q.py", "offset": 3})],
    ),
    "json_string_arguments": (
        '<tool_call>{"name": "Read", "arguments": "{\\"file_path\\": \\"s.py\\"}"}</tool_call>',
        [("call", "Read"), ("args", {"file_path": "s.py"})],
    ),
    "not_a_call": (
        "see <tool_call>nonsense</tool_call> ok",
        [("text", "see <tool_call>nonsense</tool_call> ok")],
    ),
    "bad_json_call": (
        "<tool_call>\n{not json}\n</tool_call>",
        [("text", "<tool_call>\n{not json}\n</tool_call>")],
    ),
    "markup_inside_string_value": (
        xml_call("Write", [("file_path", "t.xml"), ("content", "<parameter=x>\n</function>\n<tool_call>")]),
        [("call", "Write"), ("args", {"file_path": "t.xml", "content": "<parameter=x>\n</function>\n<tool_call>"})],
    ),
    "missing_param_close": (
        "<tool_call>\n<function=Read>\n<parameter=file_path>\nm.py\n</function>\n</tool_call>",
        [("call", "Read"), ("args", {"file_path": "m.py"})],
    ),
    "empty_call": (
        "<tool_call>\n<function=CronList>\n</function>\n</tool_call>",
        [("call", "CronList"), ("args", {})],
    ),
    "truncated_in_value": (
        "<tool_call>\n<function=Write>\n<parameter=file_path>\na.py\n</parameter>\n<parameter=content>\nx = 1\ny = ",
        [("call", "Write"), ("args", {"file_path": "a.py", "content": "x = 1\ny = "})],
    ),
    "truncated_in_tag": ("Hello <tool_ca", [("text", "Hello <tool_ca")]),
    "truncated_thinking": ("<think>hmm, let me", [("thinking", "hmm, let me"), ("end_thinking",)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_point(name):
    text, expected = CASES[name]
    assert summarize(parse(text)) == expected
    assert summarize(parse(text, list(text))) == expected, "one character at a time"
    for i in range(len(text) + 1):
        assert summarize(parse(text, [text[:i], text[i:]])) == expected, f"split at {i}: {text[:i]!r}"


def test_every_pair_of_split_points():
    text, expected = CASES["write_call"]
    text = text[text.index("<tool_call>"):]  # the call itself, to keep this quadratic test quick
    expected = [e for e in expected if e[0] != "text"]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert summarize(parse(text, [text[:i], text[i:j], text[j:]])) == expected, (i, j)


def test_string_values_stream_before_the_call_ends():
    parser = OutputParser(TOOLS)
    head = "<tool_call>\n<function=Write>\n<parameter=content>\nline one\nline two"
    events = parser.feed(head)
    assert events[0] == ToolCallStart("Write")
    streamed = "".join(e.partial_json for e in events if isinstance(e, ToolCallDelta))
    assert streamed.startswith('{"content": "line one')
    # the trailing newline is held back (it may be the one before </parameter>)
    tail = parser.feed("\n</parameter>\n</function>\n</tool_call>") + parser.finish()
    streamed += "".join(e.partial_json for e in tail if isinstance(e, ToolCallDelta))
    assert json.loads(streamed) == {"content": "line one\nline two"}
    assert tail[-1] == ToolCallEnd({"content": "line one\nline two"})


def test_start_in_thinking_and_stray_close():
    events = summarize(parse("plan it\n</think>\n\nresult", start_in_thinking=True))
    assert events == [("thinking", "plan it"), ("end_thinking",), ("text", "result")]
    # a stray </think> in text mode is dropped rather than shown
    assert summarize(parse("a</think>b")) == [("text", "ab")]


def test_tools_not_parsed_when_disabled():
    text = xml_call("Read", [("file_path", "a")])
    assert summarize(parse(text, parse_tools=False)) == [("text", text)]


def test_name_is_emitted_as_soon_as_complete():
    parser = OutputParser(TOOLS)
    assert parser.feed("<tool_call>\n<function=Rea") == []
    assert parser.feed("d>") == [ToolCallStart("Read")]


def test_convert_value():
    assert convert_value("12", frozenset({"integer"})) == 12
    assert convert_value("12.0", frozenset({"integer"})) == 12
    assert convert_value("1e3", frozenset({"number"})) == 1000.0
    assert convert_value("7", frozenset({"number"})) == 7
    assert convert_value("FALSE", frozenset({"boolean"})) is False
    assert convert_value("null", frozenset({"integer", "null"})) is None
    assert convert_value("abc", frozenset({"integer"})) == "abc"  # left for the tool to reject
    assert convert_value("{'a': None}", frozenset({"object"})) == {"a": None}
    assert convert_value(" text ", frozenset({"string"})) == " text "
    assert convert_value("true", frozenset()) is True
    assert convert_value("not json", frozenset()) == "not json"


def test_schema_types():
    assert schema_types({"type": "string"}) == {"string"}
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"anyOf": [{"type": "string"}, {"type": "null"}]}) == {"string", "null"}
    assert schema_types({"anyOf": [{"type": "string"}, {}]}) == frozenset()
    assert schema_types({"enum": ["x", 1]}) == {"string", "integer"}
    assert schema_types({"properties": {}}) == {"object"}
    assert schema_types(None) == frozenset()
