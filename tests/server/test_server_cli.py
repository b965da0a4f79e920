"""`python -m strata_jax serve` as a user runs it: binds first (503 while loading), prints `listening on URL`, serves
the bundled demo checkpoint, exits cleanly on SIGTERM; refuses a public bind without a key."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import anthropic
from server_helpers import httpx


def _lines(proc):
    """A queue fed with the process's output lines by a background thread."""
    q = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for(q, pattern, timeout, seen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no line matching {pattern!r}; output so far:\n{''.join(seen)}")


def test_serve_cli_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("STRATA_API_KEY", None)
    cache = tmp_path / "xla"
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_jax", "serve", "--port", "0", "--slots", "2", "--ctx", "256",
         "--served-name", "demo", "--compile-cache", str(cache)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    seen = []
    try:
        q = _lines(proc)
        url = _wait_for(q, r"(http://127\.0\.0\.1:\d+)/health answers 503", 60, seen).group(1)
        assert httpx.get(url + "/health").status_code == 503  # bound before the model is ready
        assert httpx.head(url + "/").status_code == 200
        listening = _wait_for(q, r"^listening on (http://\S+)$", 300, seen).group(1)
        assert listening == url
        assert sum("listening on" in line for line in seen) == 1
        assert any(f"compile cache: {cache}" in line for line in seen)
        assert any(cache.iterdir()), "the warm-up's compiled steps were not kept for the next start"
        assert httpx.get(url + "/health").status_code == 200
        c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["demo"]
        # Greedy: sampled at the API's default temperature 1 the demo model sometimes ends its turn within 5 tokens.
        msg = c.messages.create(model="demo", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                extra_body={"temperature": 0})
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
        # SIGTERM with two streams running (one per API): each ends at once with the API's retryable error
        # (Anthropic overloaded_error event; OpenAI error chunk, then [DONE]) and the server exits within ~2 s.
        streams = {"anthropic": ("/v1/messages", {"model": "demo", "max_tokens": 230, "stream": True,
                                                  "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
                                                  "stop_sequences": ["never-in-output-stop"]}),
                   "openai": ("/v1/chat/completions", {"model": "demo", "max_tokens": 230, "stream": True,
                                                       "temperature": 0, "stop": ["never-in-output-stop"],
                                                       "messages": [{"role": "user", "content": "hello"}]})}
        started, out = threading.Semaphore(0), {}

        def stream(name, path, body):
            lines = []
            with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        started.release()
            out[name] = lines
            started.release()

        threads = [threading.Thread(target=stream, args=(k, *v), daemon=True) for k, v in streams.items()]
        for t in threads:
            t.start()
        assert started.acquire(timeout=60) and started.acquire(timeout=60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
        assert took < 3.0, f"exit took {took:.1f}s"
        anthropic_tail = "\n".join(out["anthropic"][-3:])
        assert "event: error" in anthropic_tail and "overloaded_error" in anthropic_tail, out["anthropic"][-6:]
        assert "message_stop" not in "\n".join(out["anthropic"])
        assert out["openai"][-1] == "data: [DONE]" or out["openai"][-2] == "data: [DONE]", out["openai"][-6:]
        assert any('"error"' in line and "shutting down" in line for line in out["openai"][-4:]), out["openai"][-6:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_public_bind_without_key():
    env = {k: v for k, v in os.environ.items() if k != "STRATA_API_KEY"}
    res = subprocess.run([sys.executable, "-m", "strata_jax", "serve", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "without an API key" in res.stderr
    res = subprocess.run([sys.executable, "-m", "strata_jax", "serve", "--model", "/no/such/dir"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert "serve" in subprocess.run([sys.executable, "-m", "strata_jax", "--help"], capture_output=True,
                                     text=True, timeout=120).stdout
