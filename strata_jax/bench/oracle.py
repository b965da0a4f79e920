"""A benchmark-only drafter of chosen acceptance (`--draft oracle:P`, users mode; not selectable in `serve`).

A first greedy run of the same engine records each request's answer (`record`: the same compiled steps, so that the
replay meets the same numbers); the replay proposes the recorded next tokens, each replaced by a
wrong token with probability 1 - P (seeded per request and position, so the same request gets the same drafts
whatever the scheduling). The target's real verify, acceptance and rollback then run at a chosen acceptance: a draft
is accepted with probability P given the drafts before it were, as a real drafter's would be at that rate. Every row
that uses it is labelled "oracle P=..": its speed says what a drafter of that acceptance would give, not what any
real drafter gives.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from strata_jax.engine.drafters import DraftRequest

PREFIX = "oracle:"


def parse_oracle(spec: str) -> float | None:
    """P of a `--draft oracle:P` spec (0 <= P <= 1), None for any other drafter; ValueError for a bad P."""
    if not spec.startswith(PREFIX):
        return None
    try:
        p = float(spec[len(PREFIX):])
    except ValueError:
        raise ValueError(f"--draft {spec}: P must be a number in [0, 1], e.g. oracle:0.75") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"--draft {spec}: P must be in [0, 1]")
    return p


def oracle_label(p: float) -> str:
    """How tables name the oracle's rows."""
    return f"oracle P={p:g}"


@dataclasses.dataclass
class _Replay:
    record: int  # index into the drafter's records
    key: int  # the record's checksum: seeds its drafts whatever the records' order
    consumed: int  # history length at the last proposal
    proposal: list[int]
    diverged: bool = False


class OracleDrafter:
    """Replays recorded greedy sequences (prompt + answer) as drafts, each token wrong with probability 1 - P."""

    def __init__(self, records: Sequence[Sequence[int]], acceptance: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if vocab_size < 2:
            raise ValueError("an oracle needs a vocabulary of at least 2 tokens to be wrong in")
        self.acceptance, self.vocab_size, self.seed = acceptance, vocab_size, seed
        self.record(records)

    def record(self, records: Sequence[Sequence[int]]) -> None:
        """Replays `records` (prompt + greedy answer each) from now on, with fresh counts. An oracle given no
        records drafts nothing: the engine runs plain decode steps while a first pass records the answers."""
        self.records = [tuple(int(t) for t in r) for r in records]
        self._replays: dict[object, _Replay] = {}
        # What the replay saw: proposed drafts, drafts made wrong on purpose, verify windows observed (the next
        # proposal shows how many of the previous one's drafts were kept), drafts accepted in them, windows that
        # rejected a draft, and requests whose output left the record (their drafts stop).
        self.counts = dict.fromkeys(("proposed", "planted", "windows", "accepted", "rejections", "diverged"), 0)
        self.diverged_at: list[int] = []  # history lengths at which outputs left the record

    def warm_up(self) -> None:
        """Nothing to compile."""

    def propose(self, requests: Mapping[int, DraftRequest]) -> dict[int, list[int]]:
        """Each slot's recorded continuation, up to its limit, with wrong tokens planted."""
        return {slot: self._propose_one(r) for slot, r in requests.items()}

    def per_draft_acceptance(self) -> float | None:
        """Measured chance that a draft was accepted given the ones before it were (should be about P)."""
        c = self.counts
        seen = c["accepted"] + c["rejections"]
        return c["accepted"] / seen if seen else None

    def _propose_one(self, r: DraftRequest) -> list[int]:
        history = r.history
        replay = self._replays.get(r.owner)
        if replay is None:
            replay = self._start(r.owner, history)
            if replay is None:
                return []
        else:
            self._observe(replay, history)
        if replay.diverged or r.limit <= 0:
            return []
        record = self.records[replay.record]
        n = len(history)
        truth = list(record[n : n + r.limit])
        rng = np.random.default_rng([self.seed, replay.key, n])
        wrong = rng.random(len(truth)) >= self.acceptance
        shift = rng.integers(1, self.vocab_size, len(truth))  # a different token: never the recorded one
        drafts = [(t + int(s)) % self.vocab_size if w else t for t, w, s in zip(truth, wrong, shift)]
        replay.consumed, replay.proposal = n, drafts
        self.counts["proposed"] += len(drafts)
        self.counts["planted"] += int(np.sum(wrong))
        return drafts

    def _start(self, owner: object, history: Sequence[int]) -> _Replay | None:
        n = len(history)
        head = tuple(history)
        for i, record in enumerate(self.records):
            if record[:n] == head:
                key = zlib.crc32(np.asarray(record, np.int64).tobytes())
                replay = self._replays[owner] = _Replay(i, key, n, [])
                return replay
        self.counts["diverged"] += 1  # a request the first run did not record (or already left it)
        self.diverged_at.append(n)
        self._replays[owner] = _Replay(-1, 0, n, [], diverged=True)
        return None

    def _observe(self, replay: _Replay, history: Sequence[int]) -> None:
        """What became of the last proposal, and whether the output still follows the record."""
        if replay.diverged:
            return
        new = list(history[replay.consumed :])
        if replay.proposal and new:
            kept = 0
            for d, t in zip(replay.proposal, new):
                if d != t:
                    break
                kept += 1
            self.counts["windows"] += 1
            self.counts["accepted"] += kept
            self.counts["rejections"] += kept < len(replay.proposal)
        record = self.records[replay.record]
        if tuple(record[replay.consumed : len(history)]) != tuple(new):
            replay.diverged = True
            self.counts["diverged"] += 1
            self.diverged_at.append(replay.consumed + next(
                (i for i, (a, b) in enumerate(zip(record[replay.consumed:], new)) if a != b), len(new)))
        replay.consumed, replay.proposal = len(history), []
