"""The web page's side of the server: `/` answers browsers with the page and everybody else with JSON, the page's
files need no key, `/v1/monitor` shows requests while they run and after, and `--metrics-public` opens /metrics to
this machine only. (The page itself runs in a real browser in tests/server/test_web_ui.py.)"""

import collections
import re
import threading
import time

import pytest
from aiohttp.test_utils import make_mocked_request
from server_helpers import ScriptedEngine, ServerThread, fixture_tokenizer, httpx

from server.app import WEB_DIR, create_app
from server.auth import needs_key
from server.monitor import rate

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture
def serve(tokenizer):
    servers = []

    def start(engine=None, **kwargs):
        engine = engine or ScriptedEngine(tokenizer, "Hello there!")
        kwargs.setdefault("served_name", "strata-demo")
        kwargs.setdefault("api_key", None)
        kwargs.setdefault("context_length", engine.context_length)
        server = ServerThread(create_app(engine, tokenizer, **kwargs))
        servers.append(server)
        return server, engine

    yield start
    for server in servers:
        server.stop()


def test_root_is_the_page_for_browsers_and_json_for_everybody_else(serve):
    server, _ = serve(api_key="k")
    page = httpx.get(server.url + "/", headers={"accept": BROWSER_ACCEPT})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="prompt"' in page.text and 'id="monitor"' in page.text and "/ui/app.js" in page.text
    for accept in (None, "*/*", "application/json", "application/json, text/html"):
        headers = {"accept": accept} if accept else {}
        r = httpx.get(server.url + "/", headers=headers)
        assert r.status_code == 200 and r.json() == {"name": "strata_jax", "model": "strata-demo", "status": "ready"}
    assert httpx.head(server.url + "/", headers={"accept": BROWSER_ACCEPT}).status_code == 200


def test_page_files_are_served_without_a_key_and_nothing_else_is(serve):
    server, _ = serve(api_key="k")
    kinds = {"app.js": "javascript", "markdown.js": "javascript", "style.css": "text/css", "index.html": "text/html"}
    for name, kind in kinds.items():
        r = httpx.get(server.url + "/ui/" + name)
        assert r.status_code == 200 and kind in r.headers["content-type"], name
        assert r.content == (WEB_DIR / name).read_bytes()
    for path in ("/ui/nope.js", "/ui/", "/ui/..%2fapp.py", "/ui/%2e%2e/state.py"):
        r = httpx.get(server.url + path)
        assert r.status_code == 404 and r.json()["type"] == "error", path
    # No CDN, no build step: the page loads nothing from elsewhere.
    for name in kinds:
        text = (WEB_DIR / name).read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(|fetch\(["'`]https?:""", text), name


def test_monitor_needs_the_key_when_the_server_has_one(serve):
    server, _ = serve(api_key="k")
    r = httpx.get(server.url + "/v1/monitor")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server.url + "/v1/monitor", headers={"authorization": "Bearer k"})
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_monitor_shows_a_request_while_it_runs_and_after(serve, tokenizer):
    engine = ScriptedEngine(tokenizer, "word " * 60, token_delay=0.03, cached_tokens=4)
    about = {"model": "demo", "slots": 2, "plan": [["dense weights", "0.01 GiB"]]}
    server, _ = serve(engine, about=about)

    def monitor():
        return httpx.get(server.url + "/v1/monitor").json()

    idle = monitor()
    assert idle["requests"] == [] and idle["recent"]["count"] == 0 and idle["tok_s"] == 0
    assert idle["about"] == about and idle["context_length"] == engine.context_length
    body = {"model": "m", "max_tokens": 40, "stream": True, "messages": USER}
    done = threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                pass
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not done.is_set():
        snap = monitor()
        if snap["requests"] and snap["requests"][0]["output_tokens"] >= 10:
            seen.append(snap)
            if len(seen) == 2:
                break
        time.sleep(0.1)
    assert len(seen) == 2, "the request never showed in the monitor while it ran"
    live = seen[-1]["requests"][0]
    assert live["api"] == "openai" and live["state"] == "generating" and live["max_tokens"] == 40
    assert live["cached_tokens"] == 4 and live["prompt_tokens"] == len(engine.submitted[0].prompt_ids)
    assert live["ttft_s"] is not None and 5 < live["tok_s"] < 100  # ~33 tok/s scripted
    assert seen[-1]["tok_s"] > 0 and seen[-1]["slots"]["busy"] == 1
    assert done.wait(20)
    after = monitor()
    assert after["requests"] == []
    last = after["recent"]["last"][-1]
    assert last["api"] == "openai" and last["output_tokens"] == 40 and last["stop"] == "length"
    assert last["cached_tokens"] == 4 and after["recent"]["ttft_last_s"] is not None
    assert 5 < last["tok_s"] < 100


def test_monitor_reports_engine_hit_rates(serve, tokenizer):
    class Engine(ScriptedEngine):
        def stats(self):
            return {"slots_busy": 1, "slots_total": 4, "queue_length": 3, "requests_total": 9,
                    "prompt_tokens_total": 1000, "prefix_cache_hit_tokens_total": 250, "generated_tokens_total": 77,
                    "expert_gpu_hit_rate": 0.875, "draft_tokens_total": 40, "accepted_draft_tokens_total": 30}

    server, _ = serve(Engine(tokenizer))
    snap = httpx.get(server.url + "/v1/monitor").json()
    assert snap["slots"] == {"busy": 1, "total": 4} and snap["queue"] == 3
    assert snap["totals"] == {"requests": 9, "prompt_tokens": 1000, "generated_tokens": 77,
                              "prefix_cache_hit_tokens": 250, "prefix_cache_hit_rate": 0.25,
                              "expert_gpu_hit_rate": 0.875, "draft_acceptance": 0.75}


def test_metrics_public_opens_metrics_to_this_machine_only(serve):
    locked, _ = serve(api_key="k")
    assert httpx.get(locked.url + "/metrics").status_code == 401
    public, _ = serve(api_key="k", metrics_public=True)
    r = httpx.get(public.url + "/metrics")
    assert r.status_code == 200 and "strata_http_requests" in r.text
    assert httpx.get(public.url + "/v1/models").status_code == 401  # only /metrics is opened
    remote = make_mocked_request("GET", "/metrics", transport=_Transport("203.0.113.7"))
    local = make_mocked_request("GET", "/metrics", transport=_Transport("127.0.0.1"))
    assert needs_key(remote, metrics_public=True) and not needs_key(local, metrics_public=True)
    assert needs_key(local, metrics_public=False)


class _Transport:
    def __init__(self, peer):
        self.peer = peer

    def get_extra_info(self, name, default=None):
        return (self.peer, 50000) if name == "peername" else default

    def is_closing(self):
        return False


def test_rate_counts_the_trailing_window_or_a_young_stream():
    times = collections.deque([10.0 + 0.1 * i for i in range(11)])  # 11 tokens over 1 s
    assert rate(times, now=11.0) == pytest.approx(10.0)  # young stream: 10 intervals in 1 s
    old = collections.deque([0.0, *[10.0 + 0.1 * i for i in range(11)]])
    assert rate(old, now=11.0, window_s=5.0) == pytest.approx(11 / 5.0)  # the window's 11 tokens over 5 s
    assert rate(old, now=100.0) == 0.0 and rate(collections.deque(), now=1.0) == 0.0
