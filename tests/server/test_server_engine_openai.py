"""OpenAI completions, log-probabilities and the slot over the real engine: the bundled demo checkpoint served for
real, checked against the model itself (`LoadedModel.generate` and `LoadedModel.logits`)."""

import json
import logging
import time

import numpy as np
import openai
import pytest
from server_helpers import ServerThread

from server.app import create_app
from server.logs import JsonFormatter
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine import Engine, EngineConfig

PROMPT = "def add(a, b):\n"
TOLERANCE = 2e-3  # the engine's chunked prefill and decode steps against one whole-sequence forward pass


@pytest.fixture(scope="module")
def served():
    import strata_jax

    model = strata_jax.load_model(DEMO_MODEL, dtype="float32")
    engine = Engine(model, EngineConfig(slots=2, max_context=256, prefill_chunks=(32,)))
    engine.start()
    server = ServerThread(create_app(engine, model.tokenizer, served_name="demo", api_key=None,
                                     context_length=engine.context_length))
    yield server, model
    server.stop()
    engine.shutdown()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _reference_logprobs(model, prompt_ids, generated):
    """log-softmax of the model's logits at each generated position (one forward pass over the whole sequence)."""
    logits = model.logits(np.asarray([list(prompt_ids) + list(generated)]))[0].astype(np.float64)
    rows = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)]
    return rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)


def test_completions_greedy_equals_generate(served):
    server, model = served
    ids = model.tokenizer.encode(PROMPT)
    expected = [t for t in model.generate(ids, 12) if t not in model.tokenizer.eos_token_ids]
    out = client(server).completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == model.tokenizer.decode(expected)
    assert out.usage.prompt_tokens == len(ids)
    streamed = "".join(chunk.choices[0].text for chunk in client(server).completions.create(
        model="demo", prompt=ids, max_tokens=12, temperature=0, stream=True) if chunk.choices)
    assert streamed == out.choices[0].text


def test_chat_logprobs_are_the_models(served):
    server, model = served
    out = client(server).chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi!"}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert content, "the engine returned no log-probabilities"
    ended_by_eos = out.choices[0].finish_reason != "length"  # the end-of-turn token is not listed
    assert len(content) == out.usage.completion_tokens - ended_by_eos
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)


def test_completion_logprobs_match_a_forward_pass(served):
    server, model = served
    ids = model.tokenizer.encode(PROMPT)
    generated = [t for t in model.generate(ids, 6) if t not in model.tokenizer.eos_token_ids]
    out = client(server).completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0, logprobs=4)
    lp = out.choices[0].logprobs
    reference = _reference_logprobs(model, ids, generated)
    assert len(lp.token_logprobs) == len(generated)
    for i, token in enumerate(generated):
        assert lp.token_logprobs[i] == pytest.approx(reference[i, token], abs=TOLERANCE)
        best = np.sort(reference[i])[::-1][:4]
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:4] == pytest.approx(best, abs=TOLERANCE)


def test_the_log_line_names_the_slot(served):
    server, _ = served
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(json.loads(JsonFormatter().format(record)))

    logger = logging.getLogger("strata.requests")
    handler, old_level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        client(server).completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
        deadline = time.monotonic() + 10
        while not records and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert records[0]["slot"] in (0, 1) and records[0]["message"].endswith(f"slot {records[0]['slot']}")
