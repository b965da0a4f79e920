"""OpenAI legacy completions (`POST /v1/completions`) through the official `openai` SDK against a real server: the
raw prompt (text or token ids, no chat template), streaming and not, echo, stop, usage with cached tokens,
log-probabilities, and clear 400s for what is not supported."""

import json

import openai
import pytest
from fake_engines import known_logprob
from server_helpers import httpx, parse_sse

from server.completions_request import DEFAULT_MAX_TOKENS

ANSWER = "alpha beta gamma delta"


@pytest.fixture
def serve(serve):
    """The shared `serve`, answering ANSWER by default."""
    return lambda script=ANSWER, **kwargs: serve(script, **kwargs)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_prompt_is_tokenized_raw(serve, tokenizer):
    server, engine = serve(cached_tokens=2)
    out = client(server).completions.create(model="demo", prompt="def add(a, b):", max_tokens=50, temperature=0,
                                            seed=3)
    assert engine.submitted[0].prompt_ids == tuple(tokenizer.encode("def add(a, b):"))  # no chat template
    choice = out.choices[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "demo"
    assert choice.text == ANSWER and choice.finish_reason == "stop" and choice.index == 0
    assert choice.logprobs is None
    n_prompt = len(tokenizer.encode("def add(a, b):"))
    assert out.usage.prompt_tokens == n_prompt and out.usage.prompt_tokens_details.cached_tokens == 2
    assert out.usage.completion_tokens == len(tokenizer.encode(ANSWER)) + 1  # the end-of-text token counts
    sampling = engine.submitted[0].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.seed, sampling.logprobs) == (50, 0.0, 3, None)


def test_token_id_prompts_and_default_max_tokens(serve, tokenizer):
    server, engine = serve(" ".join(["word"] * 40))
    ids = tokenizer.encode("Once upon a time")
    for prompt in (ids, [ids]):
        out = client(server).completions.create(model="m", prompt=prompt)
        assert engine.submitted[-1].prompt_ids == tuple(ids)
        assert engine.submitted[-1].sampling.max_tokens == DEFAULT_MAX_TOKENS == 16  # OpenAI's default here
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16
    out = client(server).completions.create(model="m", prompt=["Once upon a time"], max_tokens=2)
    assert engine.submitted[-1].prompt_ids == tuple(ids)
    assert out.choices[0].text == tokenizer.decode(tokenizer.encode(" ".join(["word"] * 40))[:2])


def test_special_token_strings_in_the_prompt_are_special_tokens(serve, tokenizer):
    server, engine = serve()
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    client(server).completions.create(model="m", prompt=prompt, max_tokens=1)
    assert engine.submitted[0].prompt_ids == tuple(tokenizer.encode(prompt))
    assert tokenizer.token_to_id("<|im_end|>") in engine.submitted[0].prompt_ids


def test_streaming_with_usage(serve, tokenizer):
    server, _ = serve(cached_tokens=1)
    stream = client(server).completions.create(model="m", prompt="Say it:", max_tokens=100, stream=True,
                                               stream_options={"include_usage": True})
    text, finishes, usage = "", [], None
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finishes.append(choice.finish_reason)
    assert text == ANSWER and finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert usage.prompt_tokens == len(tokenizer.encode("Say it:")) and usage.prompt_tokens_details.cached_tokens == 1
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30)
    assert r.headers["content-type"].startswith("text/event-stream") and parse_sse(r.text)[-1] == (None, "[DONE]")


def test_echo_and_stop(serve, tokenizer):
    server, _ = serve()
    c = client(server)
    out = c.completions.create(model="m", prompt="Greek letters:", echo=True, max_tokens=100)
    assert out.choices[0].text == "Greek letters:" + ANSWER
    out = c.completions.create(model="m", prompt=tokenizer.encode("Greek letters:"), echo=True, max_tokens=100)
    assert out.choices[0].text == "Greek letters:" + ANSWER
    text = "".join(ch.choices[0].text for ch in c.completions.create(model="m", prompt="Greek letters:", echo=True,
                                                                       max_tokens=100, stream=True) if ch.choices)
    assert text == "Greek letters:" + ANSWER
    out = c.completions.create(model="m", prompt="x", stop=["gamma"], max_tokens=100)
    assert out.choices[0].text == "alpha beta " and out.choices[0].finish_reason == "stop"
    out = c.completions.create(model="m", prompt="x", stop="beta", max_tokens=100)
    assert out.choices[0].text == "alpha "


def test_logprobs_legacy_shape(serve, tokenizer):
    server, engine = serve("Hello wörld")
    out = client(server).completions.create(model="m", prompt="x", max_tokens=100, logprobs=2)
    assert engine.submitted[0].sampling.logprobs == 2
    text, lp = out.choices[0].text, out.choices[0].logprobs
    ids = tokenizer.encode("Hello wörld")
    assert text == "Hello wörld"
    assert len(lp.tokens) == len(ids)  # the end-of-text token is not listed: its text is not shown either
    assert lp.token_logprobs == [known_logprob(i) for i in range(len(ids))]
    for i, token_id in enumerate(ids):
        piece = tokenizer.decode([token_id])
        if "\ufffd" not in piece:  # a whole character or more: the token is its text, found at its offset
            assert lp.tokens[i] == piece and text[lp.text_offset[i]:].startswith(piece)
        else:  # a piece of a multi-byte character: named by its bytes, at the character's offset
            assert lp.tokens[i].startswith("bytes:\\x") and text[lp.text_offset[i]] == "ö"
        top = lp.top_logprobs[i]
        assert top[lp.tokens[i]] == known_logprob(i) and len(top) == 2 and max(top.values()) == known_logprob(i)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    stream = client(server).completions.create(model="m", prompt="x", max_tokens=100, logprobs=2, stream=True)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed == {key: getattr(lp, key) for key in streamed}


def test_logprobs_zero_lists_only_the_chosen_token(serve):
    server, _ = serve("ab", minus_inf_at=0)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "logprobs": 0, "max_tokens": 9}, timeout=30)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] == -9999.0  # -inf is not JSON: OpenAI's floor instead
    assert all(len(top) == 1 for top in lp["top_logprobs"])
    assert json.loads(r.text) == r.json()  # strict JSON (no -Infinity)


@pytest.mark.parametrize("patch, param, needle", [
    ({"suffix": "}"}, "suffix", "suffix: not supported"),
    ({"n": 2}, "n", "only n=1"),
    ({"best_of": 3}, "best_of", "only best_of=1"),
    ({"echo": True, "logprobs": 1}, "echo", "echo with logprobs"),
    ({"prompt": ["a", "b"]}, "prompt", "only one prompt per request"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": [1, 10**9]}, "prompt.1", "expected a token id in 0..511"),
    ({"prompt": [1, True]}, "prompt.1", "expected a token id"),
    ({"prompt": 5}, "prompt", "expected a string, an array of token ids"),
    ({"prompt": None}, "prompt", "field required"),
    ({"logprobs": 21}, "logprobs", "logprobs: must be an integer in 0..20"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens: must be an integer in 1.."),
    ({"temperature": "hot"}, "temperature", "temperature: expected a finite number"),
])
def test_unsupported_and_bad_fields_are_openai_400s(serve, patch, param, needle):
    server, engine = serve()
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(**{"model": "m", "prompt": "hi", **patch})
    assert info.value.status_code == 400 and needle in info.value.message
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == param
    assert not engine.submitted


def test_prompt_too_long(serve):
    server, engine = serve(context_length=32)
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model="m", prompt="word " * 100)
    assert "prompt is too long" in info.value.message and "> 31 maximum" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="m", prompt=list(range(40)))
    assert not engine.submitted


def test_odd_values_of_every_field_are_200s_or_openai_400s(serve):
    server, _ = serve("ok")
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "echo", "logprobs", "stream",
              "stream_options", "n", "best_of", "suffix", "model"]
    values = [None, True, -1, 0, 2**70, 1.5, "x", "", [], {}, [[]], [None], [1, [2]], {"include_usage": "yes"}]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for field in fields:
            for value in values:
                r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
                assert r.status_code in (200, 400), (field, value, r.status_code, r.text)
                if r.status_code == 400:
                    error = r.json()["error"]
                    assert error["type"] == "invalid_request_error" and error["message"], (field, value)
                elif r.headers["content-type"].startswith("text/event-stream"):
                    assert parse_sse(r.text)[-1] == (None, "[DONE]"), (field, value)
                else:
                    assert r.json()["object"] == "text_completion", (field, value)
