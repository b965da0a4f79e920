"""The server over the real engine: the fixture checkpoint served for real (4 slots, 512 tokens of context)."""

import threading
import time

import anthropic
import pytest
from conftest import FIXTURES
from server_helpers import ServerThread, httpx

from server.app import create_app
from strata_jax.engine import Engine, EngineConfig

CKPT = FIXTURES / "ckpt" / "qwen4_exp_causal"
PROMPTS = [f"Write a function number {i} that adds {i} to x." for i in range(8)]


@pytest.fixture(scope="module")
def served():
    import strata_jax

    model = strata_jax.load_model(CKPT, dtype="float32")
    engine = Engine(model, EngineConfig(slots=4, max_context=512))
    engine.start()
    server = ServerThread(create_app(engine, model.tokenizer, served_name="qwen4_exp_causal", api_key=None,
                                     context_length=engine.context_length))
    yield server, engine
    server.stop()
    engine.shutdown()


def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="local", max_retries=0, timeout=120)


def stream_once(server, prompt, max_tokens=24):
    with client(server).messages.stream(model="m", max_tokens=max_tokens, extra_body={"temperature": 0},
                                        messages=[{"role": "user", "content": prompt}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    return text, final.usage.output_tokens, final.stop_reason


def test_eight_concurrent_streams_match_sequential_runs(served):
    server, _ = served
    sequential = [stream_once(server, p) for p in PROMPTS]
    results: dict[int, object] = {}

    def worker(i):
        try:
            results[i] = stream_once(server, PROMPTS[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(not isinstance(results.get(i), Exception) and i in results for i in range(8)), results
    for i in range(8):
        assert results[i] == sequential[i], f"stream {i} differs from its sequential run"
    assert all(out[1] == 24 and out[2] == "max_tokens" for out in sequential)


def test_disconnect_frees_the_slot(served):
    server, engine = served
    cancelled_before = engine.stats()["cancelled_total"]
    body = {"model": "m", "max_tokens": 450, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to a thousand."}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "text_delta" in line:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.stats()["slots_busy"] or
                                           engine.stats()["cancelled_total"] == cancelled_before):
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["slots_busy"] == 0 and stats["cancelled_total"] == cancelled_before + 1
    text, tokens, _ = stream_once(server, "still serving?", max_tokens=4)
    assert tokens == 4


def test_real_engine_limits(served):
    server, _ = served
    with pytest.raises(anthropic.BadRequestError) as info:
        client(server).messages.create(model="m", max_tokens=10,
                                       messages=[{"role": "user", "content": "word " * 600}])
    assert "prompt is too long" in info.value.message and "> 511 maximum" in info.value.message
    # max_tokens beyond the context is clamped (raw request: the SDK refuses huge non-streaming max_tokens)
    r = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 100_000, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    usage = r.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert r.json()["stop_reason"] in ("max_tokens", "end_turn")
    assert prompt + usage["output_tokens"] <= 512
