"""Chat completions' `logprobs` / `top_logprobs` through the official `openai` SDK, over a fake engine reporting
known log-probabilities: the request maps to `SamplingParams.logprobs`, and the events' `TokenLogprob`s come back
in OpenAI's `choices[].logprobs.content[]` shape (token, logprob, bytes, top_logprobs), streaming and not."""

import openai
import pytest
from fake_engines import known_logprob, known_top
from server_helpers import httpx


ANSWER = "Hello wörld, 世界!"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served(serve):
    return serve(ANSWER)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_entries(entries, tokenizer, k):
    ids = tokenizer.encode(ANSWER)
    assert len(entries) == len(ids)  # the end-of-turn token is not listed
    assert b"".join(bytes(e.bytes) for e in entries) == ANSWER.encode()  # exact bytes, split characters too
    for i, (entry, token_id) in enumerate(zip(entries, ids, strict=True)):
        assert entry.logprob == known_logprob(i)
        piece = tokenizer.decode([token_id])
        assert entry.token == (piece if "\ufffd" not in piece else
                               "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes))
        expected_top = known_top(token_id, i, k, tokenizer.vocab_size)
        assert [t.logprob for t in entry.top_logprobs] == [lp for _, lp in expected_top]
        for top, (top_id, _) in zip(entry.top_logprobs, expected_top, strict=True):
            top_piece = tokenizer.decode([top_id])
            if "\ufffd" not in top_piece:
                assert top.token == top_piece and bytes(top.bytes) == top_piece.encode()
        if k:
            assert entry.top_logprobs[0].token == entry.token


def test_non_streaming_logprobs(served, tokenizer):
    server, engine = served
    out = client(server).chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=3)
    assert engine.submitted[-1].sampling.logprobs == 3
    assert out.choices[0].message.content == ANSWER
    _check_entries(out.choices[0].logprobs.content, tokenizer, 3)
    out = client(server).chat.completions.create(model="m", messages=USER, logprobs=True)
    assert engine.submitted[-1].sampling.logprobs == 0
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)
    out = client(server).chat.completions.create(model="m", messages=USER)
    assert engine.submitted[-1].sampling.logprobs is None and out.choices[0].logprobs is None


def test_streaming_logprobs_match_the_whole_answer(served, tokenizer):
    server, _ = served
    c = client(server)
    whole = c.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=2).choices[0].logprobs
    streamed, content = [], ""
    for chunk in c.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.content
    assert content == ANSWER and streamed == whole.content
    _check_entries(streamed, tokenizer, 2)


def test_logprob_fields_are_checked(served):
    server, engine = served
    for body, needle in [
        ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be an integer in 0..20"),
        ({"logprobs": 1}, "logprobs: expected a boolean"),
    ]:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, **body}, timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert not engine.submitted
