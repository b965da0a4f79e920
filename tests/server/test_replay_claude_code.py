"""`tools/replay_claude_code.py` against the real server app (over a scripted engine): it posts the captured Claude
Code request as sent, reports the usage the server streamed, the first-token time the engine's delay sets, the
answer's length and stop reason, and builds the next turn from the answer as `claude -p --continue` does (the
previous prompt, the answer's tool call and its result, the follow-up)."""

from __future__ import annotations

import json

from tools.replay_claude_code import DEFAULT_TURNS, FIXTURES, fixture_body, main, replay

FIRST_ANSWER = (
    "<think>\nA file is wanted.\n</think>\n\nWriting it.\n\n"
    "<tool_call>\n<function=Write>\n<parameter=file_path>\n/tmp/rev.py\n</parameter>\n"
    "<parameter=content>\ndef reverse(s):\n    return s[::-1]\n</parameter>\n</function>\n</tool_call>"
)
SECOND_ANSWER = "Done: rev.py has a docstring now."


def _script(request) -> str:
    return SECOND_ANSWER if "/tmp/rev.py" in _script.tokenizer.decode(request.prompt_ids) else FIRST_ANSWER


def test_first_turn_then_its_continuation(serve, tokenizer, tmp_path, capsys):
    _script.tokenizer = tokenizer
    server, engine = serve(_script, context_length=200_000, first_token_delay=0.3, cached_tokens=1000)
    out = tmp_path / "replay.json"
    assert main(["--url", server.url, "--json", str(out), "--follow-up", "Add a docstring."]) == 0
    first, second = json.loads(out.read_text())
    assert [first["fixture"], second["fixture"]] == list(DEFAULT_TURNS)
    for result, request in zip((first, second), engine.submitted):
        assert result["prompt_tokens"] == len(request.prompt_ids) > 20_000
        assert result["cached_tokens"] == 1000
        assert 0.3 <= result["first_token_s"] <= result["total_s"]
    assert first["stop_reason"] == "tool_use" and second["stop_reason"] == "end_turn"
    assert second["answer_tokens"] == len(tokenizer.encode(SECOND_ANSWER)) + 1  # and the end-of-turn token
    # The second prompt is the first one continued: the answer's tool call, its result and the follow-up.
    before, after = (r.prompt_ids for r in engine.submitted)
    assert after[: len(before) - 8] == before[: len(before) - 8]
    added = tokenizer.decode(after[len(before) - 8:])
    for part in ("Writing it.", "/tmp/rev.py", "return s[::-1]", "done", "Add a docstring."):
        assert part in added
    assert capsys.readouterr().out.count("first token") == 2


def test_max_tokens_override_and_server_errors(serve):
    server, engine = serve(SECOND_ANSWER, context_length=200_000)
    body = fixture_body(FIXTURES / DEFAULT_TURNS[0])
    result, blocks = replay(server.url, "first", body, api_key="local", max_tokens=3, timeout=60)
    assert (result.answer_tokens, result.stop_reason) == (3, "max_tokens")
    assert engine.submitted[-1].sampling.max_tokens == 3
    assert [b["type"] for b in blocks] == ["text"] and SECOND_ANSWER.startswith(blocks[0]["text"])
    small, _ = serve(SECOND_ANSWER, context_length=4096)  # the prompt does not fit: the server's error, exit 1
    assert main(["--url", small.url, "--turns", DEFAULT_TURNS[0]]) == 1
