"""Hostile request bodies for the HTTP APIs, and the fuzz benchmark (`python -m strata_jax.bench --mode fuzz`).

`hostile_request(rng, path)` draws one body of a class the 10,000-body fuzzing run of 2026-12-01 found defects in
(numbers far out of range, deep nesting, lone surrogates, bad UTF-8, content encodings, tool schemas a chat template
cannot render, corrupt bodies, wrong shapes) or a random mutation of a valid Claude Code / OpenAI SDK request;
`check_response` judges the answer. The suite's fuzz test (tests/server/test_server_fuzz.py) runs a few hundred
against a scripted engine; `run_fuzz` runs thousands against a real `serve` process (see its docstring).
"""

from __future__ import annotations

import collections
import gzip
import json
import random
import zlib
from typing import Any

SEED = 20261201
MESSAGES, COUNT, CHAT = "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"

ANTHROPIC_TOOL = {"name": "Write", "description": "Write a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["file_path", "content"]}}
VALID_ANTHROPIC = {
    "model": "claude-x", "max_tokens": 16, "stream": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"}, {"type": "text", "text": "Be brief."}],
    "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
    "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"}, "stop_sequences": ["END"],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "write hello.py"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "ok", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "Write",
                                           "input": {"file_path": "/tmp/h.py", "content": "print(1)"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]},
        {"role": "system", "content": "reminder"},
    ],
}
VALID_OPENAI = {
    "model": "gpt-x", "max_tokens": 16, "stream": True, "temperature": 0.2, "top_p": 0.95, "seed": 7, "n": 1,
    "stream_options": {"include_usage": True}, "stop": ["END"],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
}
NUMERIC_FIELDS = {
    MESSAGES: ["max_tokens", "top_k", "temperature", "top_p"],
    CHAT: ["max_tokens", "max_completion_tokens", "top_k", "temperature", "top_p", "seed", "n"],
}


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(14 if depth < 3 else 10)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31 - 1, 2**31, 2**63, -(2**63) - 1, 10**20, 10**400])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, -1e-300, 3.14, 2.0000001])
    if kind == 4:
        return ""
    if kind == 5:
        return rng.choice(["a", "x" * 300, "\u202e\u0000\ufeff", "<tool_call>", "<|im_end|>", "</think>", "日本語",
                           "\U0001F600", "{\"a\": 1}", "auto", "any", "none", "tool", "user", "assistant"])
    if kind == 6:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD7FF),
                                       rng.randrange(0xE000, 0x10FFFF)])) for _ in range(rng.randrange(1, 20)))
    if kind in (7, 8, 9):
        return rng.choice(["text", "image", "tool_use", "tool_result", "thinking", "document", "function"])
    if kind in (10, 11):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(["type", "text", "content", "role", "name", "input", "properties", "x"]):
            _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _paths(sub, prefix + (key,))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _paths(sub, prefix + (i,))


def _mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        paths = [p for p in _paths(body) if p]
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = rng.randrange(4)
        if action == 0 and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == 1 and isinstance(parent, list):
            parent.append(_random_value(rng))
        else:
            parent[path[-1]] = _random_value(rng)
    return body


def hostile_request(rng: random.Random, path: str) -> tuple[bytes, dict[str, str], str]:
    """(body, extra headers, class name) of one hostile request for `path`."""
    valid = VALID_OPENAI if path == CHAT else VALID_ANTHROPIC
    kind = rng.randrange(11)
    if kind == 0:  # a number far out of range, as JSON text (any size, NaN/Infinity, 310+ and 4,301 digits)
        field = rng.choice(NUMERIC_FIELDS[CHAT if path == CHAT else MESSAGES])
        literal = rng.choice([str(2**31), str(2**64), "-" + str(2**63 + 1), "1" * 310, "9" * 4301, "1e999", "NaN",
                              "-Infinity", "1" * 40 + ".5", "0.1e-400"])
        raw = json.dumps({k: v for k, v in valid.items() if k != field})
        return (raw[:-1] + f', "{field}": {literal}}}').encode(), {}, "number"
    if kind == 1:  # deep nesting, at the root or inside a field
        depth = rng.choice([129, 500, 1000, 5000, 100_000])
        opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
        nest = opener * depth + ("1" if opener != "[" else "") + closer * depth
        if rng.random() < 0.3:
            return nest.encode(), {}, "nesting"
        return (json.dumps(valid)[:-1] + f', "metadata": {nest}}}').encode(), {}, "nesting"
    if kind == 2:  # lone surrogates: escaped (in a value or a key) or as raw UTF-8-encoded surrogate bytes
        raw = json.dumps(_mutate(rng, valid) if rng.random() < 0.3 else valid)
        lone = rng.choice(["\\ud800", "\\udfff", "\\udbff x", "\\ude00\\ud83d"])
        if rng.random() < 0.5:
            return raw.replace('"model": "', '"model": "' + lone, 1).encode(), {}, "surrogate"
        return raw.encode().replace(b'"Be brief.', b'"Be brief.\xed' + bytes([rng.choice([0xa0, 0xbf])]) + b"\x80",
                                    1), {}, "surrogate"
    if kind == 3:  # invalid UTF-8 / other encodings
        bad = rng.choice([b"\xff", b"\xc3", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\xc0\xaf"])
        return json.dumps(valid).encode().replace(b"Be brief.", b"Be" + bad + b"brief.", 1), {}, "utf8"
    if kind == 4:  # content encodings: wrong, unknown, corrupt, bomb, and valid ones
        raw = json.dumps(valid).encode()
        encoding, data = rng.choice([
            ("gzip", raw), ("deflate", raw), ("br", raw), ("zstd", raw), ("compress", raw), ("x-" + "a" * 50, raw),
            ("gzip", gzip.compress(raw)[:-10]), ("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw)),
            ("gzip", gzip.compress(b"[" * 200_000)), ("gzip", gzip.compress(b" " * 2**21)), ("identity", raw),
            ("gzip, br", gzip.compress(raw)), ("deflate", bytes(rng.randrange(256) for _ in range(64)))])
        return data, {"content-encoding": encoding}, "encoding"
    if kind == 5:  # tool schemas a chat template cannot render
        deep: object = {}
        for _ in range(rng.choice([30, 70, 950])):
            deep = {"type": "object", "properties": {"a": deep}}
        schema = rng.choice([{"type": "object", "properties": 5}, {"properties": {"a": 5}}, {"properties": []},
                             {"properties": {"a": {"type": {"x": 1}}}}, {"required": "a"}, {"required": [1]},
                             {"properties": {"a": {"enum": 3}}}, deep, {"anyOf": 5, "items": "x"}])
        body = json.loads(json.dumps(valid))
        if path == CHAT:
            body["tools"][0]["function"]["parameters"] = schema
        else:
            body["tools"][0]["input_schema"] = schema
        try:
            raw = json.dumps(body).encode()
        except RecursionError:  # 950 levels: write the text directly
            raw = (json.dumps(valid)[:-1] + ', "tools": [{"name": "t", "input_schema": '
                   + '{"properties": {"a": ' * 950 + "{}" + "}}" * 950 + "}]}").encode()
        return raw, {}, "schema"
    if kind == 6:  # truncated or byte-flipped valid bodies
        raw = bytearray(json.dumps(valid).encode())
        if rng.random() < 0.5:
            return bytes(raw[: rng.randrange(len(raw))]), {}, "corrupt"
        for _ in range(rng.randrange(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw), {}, "corrupt"
    if kind == 7:  # not an object at all
        return rng.choice([b"", b"   ", b"null", b"[]", b"1", b'"x"', b"\xef\xbb\xbf{}", b"{", b"{}" * 3]), {}, "shape"
    # the rest: random mutations of a valid request
    return json.dumps(_mutate(rng, valid)).encode(), {}, "mutation"


def check_response(path: str, status: int, content_type: str, text: str, cls: str, counts: collections.Counter,
                   problems: list[str]) -> None:
    """Counts one answer by status class (and `class:status`) and appends to `problems` what breaks the rules: a
    5xx, an error body not in its API's shape, a 200 stream with an error event or without its end."""
    counts[f"{status // 100}xx"] += 1
    counts[f"{cls}:{status}"] += 1
    where = f"{cls} {path} -> {status}: {text[:200]!r}"
    if status >= 500:
        problems.append("5xx: " + where)
        return
    if status >= 400:
        try:
            body = json.loads(text)
        except ValueError:
            problems.append("not JSON: " + where)
            return
        if path == CHAT:
            ok = isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"].get("message"), str) \
                and {"type", "param", "code"} <= set(body["error"])
        else:
            ok = isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict) \
                and isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str)
        if not ok:
            problems.append("wrong error shape: " + where)
        return
    if content_type.startswith("text/event-stream"):
        frames = parse_sse(text)
        if any(name == "error" or (isinstance(data, dict) and "error" in data) for name, data in frames):
            problems.append("error event in a 200 stream: " + where)
        last = frames[-1] if frames else (None, None)
        if last != ("message_stop", {"type": "message_stop"}) and last[1] != "[DONE]":
            problems.append("stream did not finish: " + where)
    else:
        try:
            json.loads(text)
        except ValueError:
            problems.append("200 answer not JSON: " + where)




def parse_sse(raw: str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every frame of an SSE body; comment-only frames skipped."""
    frames = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if event is None and not data:
            continue
        payload = "\n".join(data)
        frames.append((event, payload if payload == "[DONE]" else json.loads(payload)))
    return frames
