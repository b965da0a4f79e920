"""How many tokens each slot drafts: a per-slot length that grows while its drafts are accepted and shrinks while
they miss (`EngineConfig.adaptive_draft`), chosen from the lengths whose verify windows are compiled.

Each slot keeps an acceptance estimate p, the chance that a draft is accepted given the drafts before it were: a
window of n drafts of which a were accepted counts a successes and, when a < n, one failure (the drafts after the
first miss say nothing about p). Both counts decay by `DECAY` per window, so p follows the request as its text
moves between copied code and new prose. The k-th draft of a window is emitted only if the k - 1 before it were
accepted: it is worth p^k tokens. A slot drafts the longest compiled length k with p^k >= `MIN_GAIN` (a wider
verify window costs a few percent of a step per token at 1-8 slots: docs/PERF.md), and none while even its first
draft is worth less than that: it then decodes plainly for `PAUSE_STEPS` steps and tries again with the shortest
length. A new request starts at `PRIOR` (p = 0.75, the seed system's acceptance: 4 drafts); 3 windows that miss
in a row pause it; after a pause, 2 fully accepted windows take it from 1 draft to 4 or more.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

DECAY = 0.7  # weight of the past per verify window
MIN_GAIN = 0.25  # the least expected tokens the last draft of a window must be worth
PAUSE_STEPS = 8  # plain decode steps after the estimate fell below MIN_GAIN, before drafting again
PRIOR = (1.5, 0.5)  # (successes, failures) a new request starts from: p = 0.75


@dataclasses.dataclass
class _Slot:
    owner: object
    hits: float = PRIOR[0]
    misses: float = PRIOR[1]
    paused: int = 0  # plain decode steps left


class DraftLengths:
    """Per-slot draft lengths from `lengths` (the compiled ones, e.g. `EngineConfig.draft_ks`)."""

    def __init__(self, lengths: Sequence[int]):
        if not lengths or min(lengths) < 1:
            raise ValueError(f"draft lengths must be positive, got {tuple(lengths)}")
        self.lengths = tuple(sorted(set(lengths)))
        self._slots: dict[int, _Slot] = {}

    def acceptance(self, slot: int) -> float:
        """The slot's current estimate of p (the prior for a slot never seen)."""
        s = self._slots.get(slot)
        hits, misses = (s.hits, s.misses) if s is not None else PRIOR
        return hits / (hits + misses)

    def length(self, slot: int, owner: object) -> int:
        """Drafts `slot` asks for this step (0: decode plainly). A new `owner` (request) starts from the prior. A
        paused slot counts one step down."""
        s = self._slots.get(slot)
        if s is None or s.owner is not owner:
            s = self._slots[slot] = _Slot(owner)
        if s.paused > 0:
            s.paused -= 1
            return 0
        k = best_length(s.hits / (s.hits + s.misses), self.lengths)
        if k == 0:
            s.paused = PAUSE_STEPS - 1  # this step is the first of the pause
            # Come back at the gain threshold: one accepted draft keeps drafting, one miss pauses again.
            s.hits, s.misses = MIN_GAIN, 1 - MIN_GAIN
        return k

    def paused(self, slot: int, owner: object) -> bool:
        """Whether `slot`'s next `length` is 0 for `owner` (a pause under way, or one about to start), without
        counting anything: the engine then may overlap the step, having no drafts to wait for."""
        s = self._slots.get(slot)
        if s is None or s.owner is not owner:
            return best_length(PRIOR[0] / (PRIOR[0] + PRIOR[1]), self.lengths) == 0
        return s.paused > 0 or best_length(s.hits / (s.hits + s.misses), self.lengths) == 0

    def update(self, slot: int, proposed: int, accepted: int) -> None:
        """A verify window of `slot` checked `proposed` drafts and accepted the first `accepted` of them."""
        s = self._slots.get(slot)
        if s is None or proposed <= 0:
            return
        s.hits = DECAY * s.hits + accepted
        s.misses = DECAY * s.misses + (1.0 if accepted < proposed else 0.0)


def best_length(p: float, lengths: Sequence[int]) -> int:
    """The longest of `lengths` whose last draft is worth at least MIN_GAIN tokens at acceptance p (p^k >= MIN_GAIN),
    0 when not even the shortest is."""
    if p <= 0.0:
        return 0
    most = math.inf if p >= 1.0 else math.log(MIN_GAIN) / math.log(p)
    fitting = [k for k in lengths if k <= most + 1e-9]
    return max(fitting) if fitting else 0
