"""A seeded fuzz run over /v1/messages, /v1/messages/count_tokens and /v1/chat/completions: hostile bodies of every
class the 10,000-body fuzzing run found (huge numbers, deep nesting, lone surrogates, bad encodings, bad tool
schemas) plus random mutations of valid requests. No 5xx, every error in its API's shape, every 200 stream complete
and error-free, and a valid stream running alongside comes through unchanged."""

import collections
import random
import threading

import pytest
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer, httpx, parse_sse

from server.app import create_app
from strata_jax.bench.fuzz_bodies import CHAT, COUNT, MESSAGES, SEED, check_response, hostile_request

N_BODIES = 360
MARKER = "ALONGSIDE-STREAM"
LONG_ANSWER = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)


def _check(path, response, cls, counts, problems):
    check_response(path, response.status_code, response.headers.get("content-type", ""), response.text, cls, counts,
                   problems)


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
                data, headers, cls = hostile_request(rng, path)
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
