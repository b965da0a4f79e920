"""The slot serving a request travels from the scheduler's `Job` to the first `TokenEvent` (for the server's log line
and monitor), and only there."""

from __future__ import annotations

from strata_jax.engine.job import Job
from strata_jax.engine.output import OutputProcessor
from strata_jax.engine.protocol import GenerationRequest, SamplingParams


class _Letters:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def test_first_event_names_the_slot():
    processor = OutputProcessor(_Letters(), lambda stream, kept: None)
    events = []
    request = GenerationRequest((1, 2), SamplingParams(max_tokens=3), "r")
    job = Job(request, processor.open(request, events.append, submitted=0.0), seed=0, submitted=0.0)
    assert job.output([], None, 0.0).slot is None  # queued: no slot yet
    job.slot = 5
    processor.process(job.output([0, 1], None, 1.0))
    processor.process(job.output([2], "length", 2.0))
    assert [e.slot for e in events] == [5, None, None]
    assert [e.text for e in events] == ["a", "b", "c"] and events[-1].finish_reason == "length"
