"""A benchmark-only drafter of chosen acceptance (`--draft oracle:P`, users mode; not selectable in `serve`).

A first greedy run of the same engine records each request's answer (`record`: the same compiled steps, so that the
replay meets the same numbers); the replay proposes the recorded next tokens, each replaced by a wrong token with
probability 1 - P (a hash of the seed, the request's record and the position decides, so the same request gets the
same drafts whatever the scheduling, and on the host and the device alike: the oracle also guesses on the device,
where chained verify windows take their drafts, `drafters.DeviceDrafter`). The target's real verify, acceptance and
rollback then run at a chosen acceptance: a draft is accepted with probability P given the drafts before it were, as
a real drafter's would be at that rate. Every row that uses it is labelled "oracle P=..": its speed says what a
drafter of that acceptance would give, not what any real drafter gives.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
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


def _mix(x):
    """A 32-bit integer hash (lowbias32), the same on numpy and jax.numpy uint32 arrays."""
    x = x ^ (x >> 16)
    x = x * x.dtype.type(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * x.dtype.type(0x846CA68B)
    return x ^ (x >> 16)


def planted(xp, seed, key, positions, truth, acceptance, vocab_size: int):
    """The oracle's drafts for history `positions` whose recorded tokens are `truth`: each one replaced by another
    token where a hash of (seed, key, position) falls at or above `acceptance`. `xp`: numpy or jax.numpy (the same
    drafts either way). Returns (drafts, wrong) as int32 and bool arrays."""
    u32 = xp.uint32
    at = xp.asarray(positions).astype(u32)  # arrays throughout: numpy wraps uint32 arrays silently, not scalars
    h = _mix(_mix(_mix(xp.zeros_like(at) + xp.asarray(seed).astype(u32)) ^ xp.asarray(key).astype(u32)) ^ at)
    wrong = (h >> 8).astype(xp.float32) * xp.float32(1.0 / (1 << 24)) >= xp.asarray(acceptance, xp.float32)
    shift = 1 + _mix(h ^ u32(0x9E3779B9)) % u32(vocab_size - 1)  # a different token: never the recorded one
    truth = xp.asarray(truth).astype(u32)
    drafts = xp.where(wrong, (truth + shift) % u32(vocab_size), truth)
    return drafts.astype(xp.int32), wrong


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
    """Replays recorded greedy sequences (prompt + answer) as drafts, each token wrong with probability 1 - P; on the
    host (`propose`) and on the device (`drafters.DeviceDrafter`: each slot's record in a device table)."""

    def __init__(self, records: Sequence[Sequence[int]], acceptance: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if vocab_size < 2:
            raise ValueError("an oracle needs a vocabulary of at least 2 tokens to be wrong in")
        self.acceptance, self.vocab_size, self.seed = acceptance, vocab_size, seed
        self._table: np.ndarray | None = None  # [slots, max_context] each slot's record (`bind`)
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
        if self._table is not None:
            self.bind(*self._table.shape)

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
        truth = np.asarray(record[n : n + r.limit], np.int64)
        drafts, wrong = planted(np, self.seed, replay.key, np.arange(n, n + len(truth)), truth, self.acceptance,
                                self.vocab_size)
        drafts = [int(t) for t in drafts]
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

    # -- on the device (`drafters.DeviceDrafter`) ----------------------------------------------------------------
    def bind(self, slots: int, max_context: int) -> None:
        """A device table of each slot's record, empty."""
        self._table = np.zeros((slots, max_context), np.int32)
        self._keys = np.zeros(slots, np.uint32)
        self._lengths = np.zeros(slots, np.int32)  # each slot's record length (0: nothing to replay)
        self._slot_record = [-1] * slots
        self._device = None  # the table's device copy, made again after a change

    def device_ready(self, slot: int, owner: object, history: Sequence[int]) -> bool:
        """Puts the record `owner` follows into `slot`'s row (settling the last host proposal first); False when
        it follows none or left it."""
        replay = self._replays.get(owner)
        if replay is None:
            replay = self._start(owner, history)
        else:
            self._observe(replay, history)
        live = replay is not None and not replay.diverged
        if live and self._slot_record[slot] != replay.record:
            record = self.records[replay.record][: self._table.shape[1]]
            self._table[slot, : len(record)] = record
            self._keys[slot], self._slot_record[slot] = replay.key, replay.record
            self._device = None
        self._set_length(slot, len(self.records[replay.record]) if live else 0)
        return live

    def device_state(self) -> tuple:
        """(table, keys, record lengths, seed, P) on the device, uploaded again only after a change."""
        if self._device is None:
            self._device = jax.device_put((self._table, self._keys, np.minimum(self._lengths, self._table.shape[1]),
                                           np.uint32(self.seed), np.float32(self.acceptance)))
        return self._device

    def device_drafts(self, state: tuple, step_drafts: jax.Array, lengths: jax.Array,
                      k: int) -> tuple[jax.Array, jax.Array]:
        """The recorded tokens at positions lengths .. lengths + k - 1, planted as on the host."""
        table, keys, record_lengths, seed, acceptance = state
        positions = lengths[:, None] + jnp.arange(k)[None, :]
        truth = jnp.take_along_axis(table, jnp.clip(positions, 0, table.shape[1] - 1), axis=1)
        drafts, _ = planted(jnp, seed, keys[:, None], positions, truth, acceptance, self.vocab_size)
        return drafts, jnp.clip(record_lengths - lengths, 0, k)

    def observe(self, slot: int, owner: object, start: int, emitted: Sequence[int], proposed: int,
                accepted: int) -> None:
        """Counts a chained window as the host path counts its windows; a slot whose output left its record
        drafts nothing from the next window uploaded on."""
        replay = self._replays.get(owner)
        if replay is None or replay.diverged:
            return
        record = self.records[replay.record]
        if proposed:
            truth = np.asarray(record[start : start + proposed], np.int64)
            _, wrong = planted(np, self.seed, replay.key, np.arange(start, start + len(truth)), truth,
                               self.acceptance, self.vocab_size)
            c = self.counts
            c["proposed"] += proposed
            c["planted"] += int(np.sum(wrong))
            c["windows"] += 1
            c["accepted"] += accepted
            c["rejections"] += accepted < proposed
        followed = next((i for i, (a, b) in enumerate(zip(record[start:], emitted)) if a != b),
                        min(len(emitted), max(len(record) - start, 0)))
        if followed < len(emitted):
            replay.diverged = True
            self.counts["diverged"] += 1
            self.diverged_at.append(start + followed)
            self._set_length(slot, 0)
        replay.consumed, replay.proposal = start + len(emitted), []

    def _set_length(self, slot: int, n: int) -> None:
        if self._lengths[slot] != n:
            self._lengths[slot] = n
            self._device = None
