"""How much prefill an engine iteration runs, and whose: the scheduler asks this policy every iteration.

The rules (docs/ARCHITECTURE.md, "Prefill and decode share the engine"):

- **Width.** While no slot decodes, a prefill call takes the largest compiled shape (`EngineConfig.chunk` tokens x
  up to `prefill_batch` prompts): nothing waits on it. While any slot decodes, it takes a mixed shape: of the
  compiled (chunk width, prompts) shapes whose call took at most `mixed_step_ms` at warm-up, the one that carries
  the most tokens for the prompts waiting (one prompt alone gets the widest piece that fits); or
  `EngineConfig.mixed_prefill` when given. A decoding stream then waits at most about that long for a token.
- **Share.** While slots decode, prefill calls get at most 1 - `decode_share` of the engine's time: a call is
  skipped (the decoders step alone) while the prefill time spent since decoding began exceeds that share of the
  decode time. A decoding stream keeps at least `decode_share` of its solo rate, whatever the widths cost. With
  `share_by_requests`, the decoders' share is at most their part of the requests in slots (D decoding, W
  prefilling: D / (D + W)), so many prompts waiting beside few decoders are not paced as if one waited.
- **Burst.** Prompts whose whole remaining prefill takes at most `prefill_burst_ms` at full width, together in
  shared calls (warm-up's timed calls; typically agents' later turns, tool results on cached prefixes, or the last
  pieces of first turns that arrived together) run at once, call after call, beside decoding slots and whatever the
  share says: decoders pause up to that long once, and the prompts' first tokens come several times sooner than in
  paced mixed pieces. A burst's time is charged to the share like any prefill, so the decoders get it back from
  the longer prompts after it (their mean rate holds); a burst
  starts only while the debt is under one burst, so bursts cannot queue up behind each other into a long stall.
- **Order.** Waiting prompts go shortest remaining prefill first (a later turn with a few thousand new tokens on a
  cached prefix overtakes a fresh 27,000-token first turn), aged: a prompt's key is its remaining tokens / (1 +
  seconds since it was submitted / `prefill_aging_s`). That alone lets a stream of short prompts hold back a long
  one for minutes (a 9,000-token tail overtakes a fresh 300-token turn only after 145 s; on the H200 two of eight
  agents' first turns waited 50 and 60 s), so a prompt waiting `STARVED_AGINGS` x `prefill_aging_s` or longer goes
  ahead of every other, the longest waiting first, and no burst overtakes it.
- **Call.** Within the width and prompt count allowed (the largest shape, a mixed shape, the burst's prompts),
  a call takes the first prompts in that order and the compiled shape that moves the most prompt tokens per second
  of its warm-up time (`fastest_call`; the widest unless another is `CLEARLY_FASTER`): a call costs its shape
  whatever its prompts fill, so short last pieces go in narrow calls instead of padding a wide one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

from strata_jax.engine.config import EngineConfig
from strata_jax.engine.job import Job


# Waiting this many prefill_aging_s (15 s at the default 5 s) puts a prompt ahead of every shorter one.
STARVED_AGINGS = 3.0


def mixed_shapes(config: EngineConfig, seconds: Mapping[tuple[str, int, int], float]) -> list[tuple[int, int]]:
    """The (chunk width, prompts) shapes a prefill call may take while slots decode: `config.mixed_prefill` if
    given, else those whose warm-up call (`seconds`, keyed (step, width, batch)) took at most
    `config.mixed_step_ms`, else the smallest (width, 1)."""
    if config.mixed_prefill is not None:
        return [tuple(config.mixed_prefill)]
    limit = config.mixed_step_ms / 1e3
    fits = sorted((w, b) for (name, w, b), s in seconds.items() if name == "prefill" and s <= limit)
    return fits or [(config.prefill_chunks[0], 1)]


def best_shape(shapes: Sequence[tuple[int, int]], waiting: int) -> tuple[int, int]:
    """Of `shapes`, the one that carries the most tokens for `waiting` prompts (then the fewest prompts)."""
    return max(shapes, key=lambda s: (s[0] * min(s[1], max(waiting, 1)), -s[1]))


# Another call shape replaces the widest one only when it moves this many times the prompt tokens per second:
# warm-up's times are one quiet call each, and a near tie is not worth a call more.
CLEARLY_FASTER = 1.5


def fastest_call(pieces: Mapping[int, Sequence[int]], batches: Sequence[int],
                 seconds: Mapping[tuple[str, int, int], float]) -> tuple[int, int] | None:
    """The (chunk width, prompts) of the prefill call that moves the most prompt tokens per second, by warm-up's
    call times (`seconds`, keyed (step, width, batch)); `pieces[width]`: the lengths of the next pieces of the
    waiting prompts, in the order they run, when cut at that width; a call of b prompts takes the first b. The
    widest width with the most prompts stays unless another is `CLEARLY_FASTER`. None when that one was not timed.
    A call costs what its shape costs, not what its prompts fill: four agents' last pieces (745 / 1,027 / 1,221 /
    2,718 tokens) in a 4,096 x 4 call took as long as a full one (1.13 s on an H100), where 1,024 x 4 calls move
    them at ~3x the rate."""

    def rate(width: int, b: int) -> float:
        took = seconds.get(("prefill", width, b))
        return sum(pieces[width][:b]) / took if took and b <= len(pieces[width]) else 0.0

    widest = (max(pieces), max(b for b in batches if b <= len(pieces[max(pieces)])))
    if not rate(*widest):
        return None
    best = max(((w, b) for w in sorted(pieces) for b in batches), key=lambda shape: rate(*shape))
    return best if rate(*best) >= CLEARLY_FASTER * rate(*widest) else widest


def choose_mixed_shape(config: EngineConfig, seconds: Mapping[tuple[str, int, int], float],
                       waiting: int | None = None) -> tuple[int, int]:
    """The mixed shape for `waiting` prompts (default: as many as a call can take)."""
    shapes = mixed_shapes(config, seconds)
    return best_shape(shapes, waiting or max(b for _, b in shapes))


class PrefillPolicy:
    """Per-iteration prefill decisions (engine thread only)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.shapes = mixed_shapes(config, {})
        self.mixed = best_shape(self.shapes, max(b for _, b in self.shapes))  # the most tokens a mixed call takes
        self._credit = 0.0  # prefill seconds the decoders' share allows now (negative: prefill is ahead)
        self._warm_up: Mapping[tuple[str, int, int], float] = {}
        self._bursting: list[Job] = []
        self.bursts = 0  # bursts started over the engine's life (/metrics)

    def warmed_up(self, seconds: Mapping[tuple[str, int, int], float]) -> None:
        """Takes the mixed shapes and the one-prompt call times from warm-up's timed calls."""
        self._warm_up = seconds
        self.shapes = mixed_shapes(self.config, seconds)
        self.mixed = best_shape(self.shapes, max(b for _, b in self.shapes))

    def reconfigure(self, config: EngineConfig) -> None:
        """Follows `config`'s pacing from now on (`Engine.set_prefill_pacing`): shapes chosen anew from the same
        warm-up times, the share's account and any burst started afresh; the counters go on."""
        self.config = config
        self._credit = 0.0
        self._bursting = []
        self.warmed_up(self._warm_up)

    def estimate(self, job: Job) -> float:
        """Seconds `job`'s remaining prefill takes alone at full width, by warm-up's calls (`estimate_together`)."""
        return self.estimate_together([job])

    def estimate_together(self, jobs: Sequence[Job], stop_past: float = math.inf) -> float:
        """Seconds the remaining prefill of `jobs` takes at full width, in that order, when their pieces share calls
        as the scheduler shares them: each call takes the first prompts left (a compiled power-of-two count) in the
        shape of the "Call" rule (`fastest`), by warm-up's call times; inf before warm-up has timed the shapes.
        Pieces are cut where the scheduler cuts them, at the call's width from where each slot's cache ends.
        `stop_past`: return as soon as the total passes it (the burst only asks whether it fits; a 25K-token first
        turn need not be simulated to its end every engine iteration)."""
        widths, batches = self.config.prefill_chunks, self.config.prefill_batches
        left = [[job.pos, len(job.fill)] for job in jobs if job.pos < len(job.fill)]
        total = 0.0
        while left:
            group = left[: max(b for b in batches if b <= len(left))]
            best = self.fastest({w: [min(w, end - pos) for pos, end in group] for w in widths}, len(group))
            if best is None:
                return math.inf
            width, prompts = best
            total += self._warm_up[("prefill", width, prompts)]
            if total > stop_past:
                return total
            for piece in group[:prompts]:
                piece[0] = min(piece[0] + width, piece[1])
            left = [piece for piece in left if piece[0] < piece[1]]
        return total

    def burst(self, jobs: Sequence[Job], decoding: bool, now: float | None = None) -> list[Job]:
        """The prompts to prefill at once this iteration (see "Burst"), in `jobs`' order; [] for none. While slots
        decode: those of the burst going on that still prefill; else, while the share's debt is under one burst,
        the first of `jobs` (in `order`) whose remaining prefill fits `prefill_burst_ms` and each next one that
        still fits with those taken (`estimate_together`: they share calls); never one behind a starved prompt
        (bursts are charged to the share, so short prompts bursting past it would hold it back again). With
        nobody decoding, []: every call is full width then, several prompts together."""
        limit = self.config.prefill_burst_ms / 1e3
        if not decoding or limit <= 0 or self.config.decode_share <= 0:
            self._bursting = []
            return []
        going = [job for job in jobs if job in self._bursting]
        if going:
            return going
        self._bursting = []
        if self._credit <= -limit:
            return []
        if jobs and self.starved(jobs[0], now):
            jobs = jobs[:1]
        for job in jobs:
            if self.estimate_together([*self._bursting, job], stop_past=limit) <= limit:
                self._bursting.append(job)
        self.bursts += bool(self._bursting)
        return list(self._bursting)

    def fastest(self, pieces: Mapping[int, Sequence[int]], most: int) -> tuple[int, int] | None:
        """`fastest_call` among warm-up's shapes of at most `most` prompts (None before warm-up's timings)."""
        batches = [b for b in self.config.prefill_batches if b <= most]
        return fastest_call(pieces, batches, self._warm_up)

    def shape(self, decoding: bool, waiting: int = 1) -> tuple[int, int]:
        """(the widest piece a prompt may take, the most prompts) of this iteration's prefill call, with `waiting`
        prompts ready to prefill."""
        if decoding:
            return best_shape(self.shapes, waiting)
        return self.config.chunk, max(self.config.prefill_batches)

    def may_prefill(self, decoding: bool) -> bool:
        """Whether this iteration runs a prefill call (always while nobody decodes)."""
        if not decoding or self.config.decode_share <= 0:
            return True
        return self._credit >= 0

    def prefilled(self, seconds: float, decoding: bool) -> None:
        """A prefill call took `seconds` (with `decoding` slots waiting on it, it is charged to the share)."""
        if decoding:
            self._credit -= seconds

    def share(self, decoders: int, waiting: int) -> float:
        """The decoders' share of the engine's time with `decoders` slots decoding and `waiting` prefilling (see
        "Share")."""
        share = self.config.decode_share
        if self.config.share_by_requests and decoders > 0 and waiting > 0:
            share = min(share, decoders / (decoders + waiting))
        return share

    def decoded(self, seconds: float, prefilling: int, decoders: int = 1) -> None:
        """A decode or verify step of `decoders` slots took `seconds`; while `prefilling` prompts wait, it earns
        them their share of time."""
        share = self.share(decoders, prefilling)
        if not prefilling or share <= 0:
            self._credit = 0.0
            return
        # A one-call cap: a burst of prefill after a long decode-only stretch would stall the decoders.
        self._credit = min(self._credit + seconds * (1 - share) / share, self.config.mixed_step_ms / 1e3)

    def starved(self, job: Job, now: float | None = None) -> bool:
        """Whether `job` has waited `STARVED_AGINGS` agings or longer (it goes ahead of every other)."""
        now = time.monotonic() if now is None else now
        return now - job.submitted >= STARVED_AGINGS * max(self.config.prefill_aging_s, 1e-9)

    def order(self, jobs: Sequence[Job], now: float | None = None) -> list[Job]:
        """`jobs` (prefilling) in the order their pieces should run: those waiting `STARVED_AGINGS` agings or longer
        first, the longest waiting first; then shortest remaining prefill first, aged."""
        now = time.monotonic() if now is None else now
        aging = max(self.config.prefill_aging_s, 1e-9)

        def key(job: Job) -> tuple[bool, float, float]:
            waited = max(now - job.submitted, 0.0)
            if self.starved(job, now):
                return False, job.submitted, 0.0
            return True, (len(job.fill) - job.pos) / (1.0 + waited / aging), job.submitted

        return sorted(jobs, key=key)
