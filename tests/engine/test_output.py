"""The output processor alone (no model): text held back while it may start a stop string, a match ends the
stream with the text before it and frees the slot once, later output of that request is dropped, and a
token-level end flushes what was held."""

from __future__ import annotations

from strata_jax.engine.output import OutputProcessor, RequestOutput, cut_stop_strings
from strata_jax.engine.protocol import GenerationRequest, SamplingParams


class _Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def _open(processor, **sampling):
    events = []
    request = GenerationRequest((1, 2, 3), SamplingParams(**sampling), "r")
    return processor.open(request, events.append, submitted=0.0), events


def test_cut_stop_strings_holds_back_possible_starts():
    assert cut_stop_strings("", "abcx", ("xyz",)) == ("abc", None, "x")
    assert cut_stop_strings("x", "y", ("xyz",)) == ("", None, "xy")
    assert cut_stop_strings("xy", "zq", ("xyz", "q")) == ("", "xyz", "")
    assert cut_stop_strings("", "ab", ("zz",)) == ("ab", None, "")


def test_stop_string_ends_the_stream_and_frees_the_slot_once():
    ended = []
    processor = OutputProcessor(_Letters(), lambda stream, kept: ended.append((stream, kept)))
    stream, events = _open(processor, stop_strings=("cd",))
    processor.process(RequestOutput(stream, (0, 1, 2), cached_tokens=2, admitted=1.0, first_token=2.0, at=2.0))
    assert [e.text for e in events] == ["a", "b", ""]  # "c" may start "cd": held back
    assert events[0].prompt_tokens == 3 and events[0].cached_tokens == 2 and events[1].prompt_tokens == 0
    processor.process(RequestOutput(stream, (3, 4), draft_tokens=5, accepted_draft_tokens=2, first_token=2.0, at=4.0))
    assert len(events) == 4
    final = events[-1]
    assert final.finish_reason == "stop_string" and final.stop_string == "cd" and final.text == ""
    assert final.completion_tokens == 4 and final.draft_tokens == 5 and final.accepted_draft_tokens == 2
    assert final.timing.decode_tokens_per_s == 3 / 2.0
    assert ended == [(stream, 4)]
    processor.process(RequestOutput(stream, (5,), finish_reason="length"))  # the engine ran on meanwhile
    processor.process(RequestOutput(stream, finish_reason="cancelled"))
    assert len(events) == 4 and ended == [(stream, 4)]
    assert processor.generated == 4


def test_token_level_end_flushes_held_text():
    processor = OutputProcessor(_Letters(), lambda stream, kept: None)
    stream, events = _open(processor, stop_strings=("cd",))
    processor.process(RequestOutput(stream, (0, 2), finish_reason="length"))
    assert [e.text for e in events] == ["a", "c"] and events[-1].finish_reason == "length"
    stream, events = _open(processor)
    processor.process(RequestOutput(stream, (0, 7), finish_reason="stop"))  # a stop token has no text
    assert [e.text for e in events] == ["a", ""] and events[-1].finish_reason == "stop"
    stream, events = _open(processor)
    processor.process(RequestOutput(stream, (0,)))
    processor.process(RequestOutput(stream, finish_reason="cancelled"))
    assert events[-1].token_id is None and events[-1].completion_tokens == 1
