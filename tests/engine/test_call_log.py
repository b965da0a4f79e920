"""`CallLog` (EngineConfig.call_log): the engine thread's calls with their times, for benchmark timelines."""

from __future__ import annotations

import time

import pytest

from strata_jax.engine import EngineConfig
from strata_jax.engine.call_log import Call, CallLog, by_shape


def test_an_off_log_keeps_nothing():
    log = CallLog(0)
    with log.timed("prefill", width=16):
        pass
    assert not log and log.calls() == []


def test_the_log_keeps_the_last_calls_with_their_times_and_not_failed_ones():
    log = CallLog(2)
    before = time.perf_counter()
    with log.timed("decode", slots=(0, 1)):
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with log.timed("prefill", width=32, pieces=((0, 0, 32, 40),)):
            raise RuntimeError("a failed call")
    with log.timed("prefill", width=32, pieces=((0, 0, 32, 40), (1, 8, 20, 20))):
        pass
    with log.timed("snapshot", slots=(1,), tokens=20):
        pass
    calls = log.calls()
    assert [c.kind for c in calls] == ["prefill", "snapshot"]  # the oldest fell out; the failed one never came in
    assert calls[0].start >= before and calls[1].start >= calls[0].start + calls[0].seconds
    assert log.calls(since=calls[1].start) == calls[1:]
    assert calls[0].as_dict(origin=calls[0].start) == {
        "kind": "prefill", "start_s": 0.0, "seconds": round(calls[0].seconds, 6), "width": 32,
        "pieces": [[0, 0, 32, 40], [1, 8, 20, 20]]}
    assert calls[1].as_dict(origin=0.0)["slots"] == [1] and calls[1].as_dict()["tokens"] == 20


def test_prefill_calls_by_shape():
    calls = [Call("prefill", 0.0, 1.0, width=4096, pieces=((0, 0, 4096, 9000),) * 4),
             Call("prefill", 1.0, 0.5, width=1024, pieces=((0, 0, 700, 700),) * 4),
             Call("prefill", 1.5, 1.0, width=4096, pieces=((0, 0, 4096, 9000),) * 4),
             Call("decode", 2.5, 0.02, slots=(0,)),
             Call("prefill", 2.6, 0.1, width=1024, pieces=((0, 0, 1000, 1000),))]
    assert by_shape(calls) == {"4096x4": (2, 2.0), "1024x4": (1, 0.5), "1024x1": (1, 0.1)}


def test_call_log_size_is_checked():
    with pytest.raises(ValueError, match="call_log"):
        EngineConfig(call_log=-1)
    assert EngineConfig().call_log == 0
