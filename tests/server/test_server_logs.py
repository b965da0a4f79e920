"""What `serve` logs: one line per generation request at its end (both APIs, normal ends and cancellations), the same
as one JSON object per line with `--log-format json`, no access lines for polling, and the start-up summary."""

import io
import json
import logging
import threading
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer, httpx

from server.app import create_app
from server.logs import LOGGED, JsonFormatter, QuietAccessLogger, configure_logging, startup_lines

USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture
def server(tokenizer):
    engine = ScriptedEngine(tokenizer, "Hello there, a short answer.", cached_tokens=3, token_delay=0.01)
    srv = ServerThread(create_app(engine, tokenizer, served_name="demo", api_key=None,
                                  context_length=engine.context_length))
    yield srv, engine
    srv.stop()


@pytest.fixture
def request_lines():
    """The records of the `strata.requests` logger, as the JSON formatter writes them."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(json.loads(JsonFormatter().format(record)))

    logger = logging.getLogger("strata.requests")
    handler = Keep()
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


def _wait_for(records, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len(records) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return records


def test_one_line_per_request_with_its_numbers(server, request_lines):
    srv, engine = server
    r = httpx.post(srv.url + "/v1/messages", json={"model": "m", "max_tokens": 50, "messages": USER})
    assert r.status_code == 200
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": USER})
    assert r.status_code == 200
    httpx.get(srv.url + "/v1/models")  # not a generation: no request line
    lines = _wait_for(request_lines, 2)
    assert len(lines) == 2
    anthropic, openai = lines
    usage = r.json()["usage"]
    assert anthropic["api"] == "anthropic" and anthropic["stop"] == "end_turn"
    assert anthropic["output_tokens"] == len(engine.tokenizer.encode("Hello there, a short answer.")) + 1
    assert anthropic["prompt_tokens"] == len(engine.submitted[0].prompt_ids) and anthropic["cached_tokens"] == 3
    assert openai["api"] == "openai" and openai["stop"] == "length" and openai["output_tokens"] == 4
    assert openai["prompt_tokens"] == usage["prompt_tokens"]
    for line in lines:
        assert line["event"] == "request" and line["request_id"].startswith("req_")
        assert line["ttft_s"] is not None and line["tok_s"] > 0 and line["duration_s"] > 0
        assert line["request_id"] in line["message"] and "TTFT" in line["message"] and "tok/s" in line["message"]


def test_a_dropped_stream_is_logged_as_cancelled(tokenizer, request_lines):
    engine = ScriptedEngine(tokenizer, "word " * 200, token_delay=0.02)
    srv = ServerThread(create_app(engine, tokenizer, served_name="demo", api_key=None, context_length=4096))
    try:
        body = {"model": "m", "max_tokens": 150, "stream": True, "messages": USER}
        with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 12:
                    break
        line = _wait_for(request_lines, 1)[0]
    finally:
        srv.stop()
    assert line["stop"] == "cancelled (client gone)" and 0 < line["output_tokens"] < 150


def test_json_log_format_writes_one_object_per_line():
    out = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("json", stream=out)
        logging.getLogger("strata.server").info("hello %s", "there", extra={"fields": {"url": "http://x"}})
        logging.getLogger("strata.server").debug("not shown")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["message"] == "hello there" and record["level"] == "info" and record["url"] == "http://x"
    assert record["logger"] == "strata.server" and record["time"].endswith("+00:00")
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("xml")


def test_access_log_skips_polling_and_logged_requests():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("test.access")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    access = QuietAccessLogger(logger, '%r %s')
    ok, missing = web.Response(status=200), web.Response(status=404)
    access.log(make_mocked_request("GET", "/v1/monitor"), ok, 0.01)
    access.log(make_mocked_request("GET", "/ui/app.js"), ok, 0.01)
    access.log(make_mocked_request("GET", "/ui/nope.js"), missing, 0.01)  # failures still show
    logged = make_mocked_request("POST", "/v1/messages")
    logged[LOGGED] = True
    access.log(logged, ok, 0.01)
    access.log(make_mocked_request("GET", "/v1/models"), ok, 0.01)
    assert len(seen) == 2 and "/ui/nope.js" in seen[0] and "/v1/models" in seen[1]


def test_startup_summary_says_how_to_connect_and_never_shows_the_key():
    about = {"model": "/models/flash", "dtype": "bfloat16", "backend": "gpu", "slots": 4, "context": 65536,
             "draft": "mtp", "plan_summary": "20.1 of 23.9 GiB on the device planned"}
    lines = startup_lines("http://127.0.0.1:8080", "flash", about, key_hint="$STRATA_API_KEY", metrics_public=True)
    text = "\n".join(lines)
    assert "4 x 65,536 tokens of context, drafter mtp" in text
    assert "/models/flash (bfloat16, gpu), served as 'flash'" in text
    assert "20.1 of 23.9 GiB on the device planned" in text
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_AUTH_TOKEN=$STRATA_API_KEY ANTHROPIC_MODEL=flash" in text
    assert "http://127.0.0.1:8080/  (chat and live monitor)" in text and "no key needed from this machine" in text
    assert not any("listening on" in line for line in lines)  # that line stays the one ready marker
    open_server = "\n".join(startup_lines("http://h:1", "m", {}, key_hint=None, metrics_public=False))
    assert "ANTHROPIC_AUTH_TOKEN=local" in open_server and "no key needed" not in open_server


def test_request_lines_are_thread_safe_under_concurrency(server, request_lines):
    srv, _ = server
    threads = [threading.Thread(target=lambda: httpx.post(
        srv.url + "/v1/chat/completions", json={"model": "m", "max_tokens": 3, "messages": USER}, timeout=30))
        for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    lines = _wait_for(request_lines, 6)
    assert len({line["request_id"] for line in lines}) == 6
    assert all(line["output_tokens"] == 3 and line["stop"] == "length" for line in lines)
