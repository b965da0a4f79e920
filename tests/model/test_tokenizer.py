"""Tokenizer tests against reference outputs recorded from transformers (tests/fixtures/tokenizer/chat_cases.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from strata_jax.tokenizer import IncrementalDecoder, TemplateError, Tokenizer, load_tokenizer

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"
CASES = json.loads((FIXTURE_DIR / "chat_cases.json").read_text(encoding="utf-8"))
CHAT_CASES = CASES["chat_cases"]
ENCODE_CASES = CASES["encode_cases"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(FIXTURE_DIR)


def _chat_kwargs(case: dict) -> dict:
    kwargs = {"tools": case.get("tools"), "add_generation_prompt": case["add_generation_prompt"]}
    if "enable_thinking" in case:
        kwargs["enable_thinking"] = case["enable_thinking"]
    return kwargs


@pytest.mark.parametrize("case", [c for c in CHAT_CASES if "text" in c], ids=lambda c: c["name"])
def test_chat_template_matches_transformers(tok: Tokenizer, case: dict) -> None:
    assert tok.apply_chat_template(case["messages"], **_chat_kwargs(case)) == case["text"]
    assert tok.apply_chat_template(case["messages"], tokenize=True, **_chat_kwargs(case)) == case["ids"]


@pytest.mark.parametrize("case", [c for c in CHAT_CASES if "error" in c], ids=lambda c: c["name"])
def test_chat_template_raise_exception(tok: Tokenizer, case: dict) -> None:
    with pytest.raises(TemplateError) as excinfo:
        tok.apply_chat_template(case["messages"], **_chat_kwargs(case))
    assert str(excinfo.value) == case["error"]


@pytest.mark.parametrize("case", ENCODE_CASES, ids=lambda c: repr(c["text"][:20]))
def test_encode_decode_matches_transformers(tok: Tokenizer, case: dict) -> None:
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.encode(case["text"], add_special_tokens=True) == case["ids_with_special"]
    assert tok.decode(case["ids"]) == case["decoded"]
    assert tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"]


def test_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == CASES["vocab_size"] == 512
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == CASES["eos_token_id"]
    assert tok.pad_token_id == CASES["pad_token_id"]
    assert tok.bos_token is None and tok.bos_token_id is None
    assert sorted(tok.special_token_ids) == CASES["all_special_ids"]
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_template_variables_and_filters(tok: Tokenizer, tmp_path: Path) -> None:
    d = _copy_fixture(tmp_path)
    template = (
        "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ extra_var }}|"
        "{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=True, separators=(',', ':')) }}|"
        "{{ {'a': 1} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% break %}{% endfor %}"
    )
    (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    rendered = Tokenizer(d).apply_chat_template(
        [{"role": "user", "content": "<é>&"}, {"role": "assistant", "content": None}], extra_var=7
    )
    assert rendered == '<|im_end|>|<|endoftext|>|False|7|"<é>&"|{"a":[1,2],"b":1}|{\n  "a": 1\n}|4|assistant'


def test_enable_thinking_none_leaves_variable_undefined(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == tok.apply_chat_template(msgs, enable_thinking=True)
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_named_templates(tmp_path: Path) -> None:
    d = _copy_fixture(tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    t = Tokenizer(d)
    msgs = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(msgs) == "D"
    assert t.apply_chat_template(msgs, tools=[]) == "T"
    assert t.apply_chat_template(msgs, template_name="tool_use") == "T"


# Strings whose characters are split over several byte-level tokens in the tiny vocab.
STREAM_TEXTS = ["Grüße 你好 🎉👍🏽 naïve", "日本語も可。\n😊😊 end", "<|im_start|>é<|im_end|>", "a\u0301bc 🇫🇷"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_incremental_decoder_matches_full_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special_tokens=skip)
    assert dec.ids == tuple(ids)


def test_incremental_decoder_holds_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji is split across byte tokens in this vocab
    dec = IncrementalDecoder(tok)
    assert [dec.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1]) == "🎉"
    assert dec.flush() == ""


def test_incremental_decoder_flushes_invalid_bytes(tok: Tokenizer) -> None:
    partial = tok.encode("🎉")[:-1]
    dec = IncrementalDecoder(tok)
    assert dec.push_many(partial) == ""
    assert dec.flush() == tok.decode(partial)
    assert dec.push_many(tok.encode("ok")) == "ok"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(tmp_path)


def test_loads_without_config(tmp_path: Path) -> None:
    shutil.copy(FIXTURE_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    t = Tokenizer(tmp_path / "tokenizer.json")
    assert t.vocab_size == 512 and t.eos_token is None and t.chat_template_names == ()
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_generation_config_eos(tmp_path: Path) -> None:
    d = _copy_fixture(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [505, 7]}), encoding="utf-8")
    assert Tokenizer(d).eos_token_ids == {503, 505, 7}


def test_invalid_template_names_file(tmp_path: Path) -> None:
    d = _copy_fixture(tmp_path)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(TemplateError, match="chat_template.jinja"):
        Tokenizer(d)


def test_invalid_template_in_config_names_file(tmp_path: Path) -> None:
    d = _copy_fixture(tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "{% if %}"
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(TemplateError, match="tokenizer_config.json"):
        Tokenizer(d)


def test_sandbox_blocks_unsafe_access(tok: Tokenizer, tmp_path: Path) -> None:
    d = _copy_fixture(tmp_path)
    (d / "chat_template.jinja").write_text("{{ messages.append(1) }}", encoding="utf-8")
    with pytest.raises(Exception, match="unsafe|immutable|not safely"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}])


def _copy_fixture(tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE_DIR / name, d / name)
    return d


@pytest.mark.parametrize("where", ["tokenizer", "demo", "ckpt/qwen3_next"])
def test_encoding_in_pieces_equals_encoding_whole(where: str) -> None:
    """The server encodes long prompts in pieces (the event loop stays responsive): same ids as one call, on the
    Claude Code fixture's rendered prompt and on text with every kind of line ending and indentation."""
    import random

    from strata_jax.demo import DEMO_MODEL
    from strata_jax.tokenizer import TooManyTokens

    tok = load_tokenizer(DEMO_MODEL if where == "demo" else FIXTURE_DIR.parent / where)
    body = json.loads((FIXTURE_DIR.parent / "claude_code" / "claude_code_first_turn.json").read_text())["body"]
    system = "\n".join(b["text"] for b in body["system"])
    texts = [system + json.dumps(body["tools"], indent=2)]
    rng = random.Random(0)
    parts = ["\n", "\n\n", "\r\n", "  ", "\t", "};", "x", "é", "世", "42", " ", "<|im_start|>", "'s", "ab"]
    texts += ["".join(rng.choice(parts) for _ in range(4000)) for _ in range(4)]
    for text in texts:
        whole = tok.encode(text)
        for size in (1, 7, 64, 1000):
            assert tok.encode_in_pieces(text, piece_chars=size) == whole
    with pytest.raises(TooManyTokens) as info:
        tok.encode_in_pieces(texts[0], stop_after=1000, piece_chars=512)
    assert 1000 < info.value.count < len(tok.encode(texts[0])) and not info.value.exact
