"""`CallLog`: what the engine thread ran and when (prefill calls with each prompt's piece, decode and verify steps,
prefix restores and snapshots), kept when `EngineConfig.call_log` > 0. A benchmark's percentiles say that a first
token came late; the log says behind which calls (`bench --mode agents --trace`). JAX-free, engine thread only for
writing; `calls` may be read from any thread."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


@dataclasses.dataclass(frozen=True)
class Call:
    """One call: `kind` ("prefill", "decode", "verify", "launch", "land", "restore", "snapshot"), when it started
    (`time.perf_counter()`), how long it took, and what it ran: for a prefill, the compiled width and one
    (slot, first position, end position, prompt tokens) per prompt; for a step, the slots it carried; for a
    restore or snapshot, the slot and the tokens restored or kept."""

    kind: str
    start: float
    seconds: float
    slots: tuple[int, ...] = ()
    width: int = 0
    pieces: tuple[tuple[int, int, int, int], ...] = ()
    tokens: int = 0

    def as_dict(self, origin: float = 0.0) -> dict:
        """JSON-ready, `start` in seconds from `origin`; empty fields left out."""
        out = {"kind": self.kind, "start_s": round(self.start - origin, 6), "seconds": round(self.seconds, 6),
               "slots": list(self.slots), "width": self.width, "pieces": [list(p) for p in self.pieces],
               "tokens": self.tokens}
        return {k: v for k, v in out.items() if v or k in ("kind", "start_s", "seconds")}


class CallLog:
    """The last `size` calls (0: keeps none, and costs nothing but a check)."""

    def __init__(self, size: int):
        self.size = size
        self._calls: collections.deque[Call] = collections.deque(maxlen=max(size, 1))

    def __bool__(self) -> bool:
        return self.size > 0

    @contextmanager
    def timed(self, kind: str, **what) -> Iterator[None]:
        """Times the body as one call of `kind` (`what`: Call's other fields); records nothing when it raises."""
        if not self.size:
            yield
            return
        start = time.perf_counter()
        yield
        self._calls.append(Call(kind, start, time.perf_counter() - start, **what))

    def calls(self, since: float = float("-inf")) -> list[Call]:
        """The calls that started at or after `since` (a `time.perf_counter()` value), oldest first."""
        for _ in range(100):  # the engine thread may append meanwhile: copy again
            try:
                return [c for c in list(self._calls) if c.start >= since]
            except RuntimeError:
                continue
        return []


def by_shape(calls: Sequence[Call]) -> dict[str, tuple[int, float]]:
    """Prefill calls per compiled shape ("WIDTHxPROMPTS"): (how many, seconds in all), the widest first."""
    out: dict[str, list] = {}
    for c in sorted((c for c in calls if c.kind == "prefill"), key=lambda c: (-c.width, -len(c.pieces))):
        entry = out.setdefault(f"{c.width}x{len(c.pieces)}", [0, 0.0])
        entry[0] += 1
        entry[1] += c.seconds
    return {k: (n, s) for k, (n, s) in out.items()}
