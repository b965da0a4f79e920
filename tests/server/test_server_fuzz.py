"""A seeded fuzz run over /v1/messages, /v1/messages/count_tokens and /v1/chat/completions: hostile bodies of every
class the 10,000-body fuzzing run found (huge numbers, deep nesting, lone surrogates, bad encodings, bad tool
schemas) plus random mutations of valid requests. No 5xx, every error in its API's shape, every 200 stream complete
and error-free, and a valid stream running alongside comes through unchanged."""

import collections
import gzip
import json
import random
import threading
import zlib

import pytest
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer, httpx, parse_sse

from server.app import create_app

SEED = 20261201
N_BODIES = 360
MESSAGES, COUNT, CHAT = "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"
MARKER = "ALONGSIDE-STREAM"
LONG_ANSWER = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)

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


def _hostile(rng: random.Random, path: str) -> tuple[bytes, dict[str, str], str]:
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


def _check(path: str, response: httpx.Response, cls: str, counts: collections.Counter, problems: list[str]) -> None:
    counts[f"{response.status_code // 100}xx"] += 1
    counts[f"{cls}:{response.status_code}"] += 1
    where = f"{cls} {path} -> {response.status_code}: {response.text[:200]!r}"
    if response.status_code >= 500:
        problems.append("5xx: " + where)
        return
    if response.status_code >= 400:
        try:
            body = response.json()
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
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        frames = parse_sse(response.text)
        if any(name == "error" or (isinstance(data, dict) and "error" in data) for name, data in frames):
            problems.append("error event in a 200 stream: " + where)
        last = frames[-1] if frames else (None, None)
        if last != ("message_stop", {"type": "message_stop"}) and last[1] != "[DONE]":
            problems.append("stream did not finish: " + where)
    else:
        response.json()


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


def test_fuzz_no_5xx_errors_in_shape_and_a_stream_alongside_unchanged(tokenizer):
    def script(request):
        return LONG_ANSWER if MARKER in tokenizer.decode(request.prompt_ids) else "Hi.<tool_call>\n<function=Write>"

    engine = ScriptedEngine(tokenizer, script, token_delay=0.002)
    server = ServerThread(create_app(engine, tokenizer, served_name="m", api_key=None, context_length=4096,
                                     max_body_bytes=2**20))
    counts: collections.Counter = collections.Counter()
    problems: list[str] = []
    stop = threading.Event()
    alongside: list[str] = []

    def stream_alongside():
        with httpx.Client(base_url=server.url, timeout=60) as http:
            while not stop.is_set() or not alongside:
                body = {"model": "m", "max_tokens": 1000, "stream": True,
                        "messages": [{"role": "user", "content": MARKER}]}
                response = http.post(MESSAGES, json=body)
                frames = parse_sse(response.text)
                text = "".join(d["delta"]["text"] for name, d in frames if name == "content_block_delta")
                alongside.append(text if frames[-1][0] == "message_stop" else f"unfinished: {response.text[-300:]}")

    thread = threading.Thread(target=stream_alongside, daemon=True)
    thread.start()
    rng = random.Random(SEED)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(N_BODIES):
                path = rng.choice([MESSAGES, MESSAGES, COUNT, CHAT, CHAT])
                data, headers, cls = _hostile(rng, path)
                response = http.post(path, content=data, headers={"content-type": "application/json", **headers})
                _check(path, response, cls, counts, problems)
    finally:
        stop.set()
        thread.join(60)
        server.stop()
    summary = {k: v for k, v in sorted(counts.items()) if k.endswith("xx")}
    print(f"\nfuzz status classes over {N_BODIES} bodies: {summary}; {len(alongside)} streams alongside; by class: "
          f"{dict(sorted((k, v) for k, v in counts.items() if not k.endswith('xx')))}")
    assert not problems, f"{len(problems)} problems, e.g.:\n" + "\n".join(problems[:15])
    assert summary.get("4xx", 0) > N_BODIES // 2 and summary.get("2xx", 0) > 10, summary
    assert alongside and all(text == LONG_ANSWER for text in alongside), alongside[:3]
