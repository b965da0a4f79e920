"""Prefix cache: host-memory snapshots of one slot's state after a known token prefix, LRU under a byte budget.

Attention KV could simply be truncated, but Gated DeltaNet / conv / PLE state cannot be rewound, so a reusable
prefix needs the whole state as it was right after that prefix. Snapshots live in host RAM rather than on the
GPU: the GPU's memory goes to weights and live slots, a snapshot is restored once per request (a
host->device copy of one slot, small next to the prefill it saves), and host RAM is the larger pool. KV is stored
only up to the prefix length.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from strata_jax.model.cache import ModelCache, map_kv_positions


def _positions(axis: int, stop: int) -> tuple:
    return (slice(None),) * axis + (slice(0, stop),)


@dataclasses.dataclass
class Snapshot:
    tokens: tuple[int, ...]
    state: ModelCache  # host arrays, batch 1, KV cut to the prefix length
    nbytes: int
    last_used: int


class PrefixCache:
    """Longest-prefix lookup over snapshots; `insert` evicts least recently used ones beyond `budget_bytes`."""

    def __init__(self, budget_bytes: int, kv_block: int = 1):
        self.budget = budget_bytes
        self.kv_block = kv_block
        self._snaps: dict[tuple[int, ...], Snapshot] = {}
        self._clock = itertools.count()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def lookup(self, prompt: Sequence[int]) -> Snapshot | None:
        """The snapshot with the longest token prefix of `prompt` that leaves at least one token to prefill."""
        prompt = tuple(prompt)
        best = None
        for snap in self._snaps.values():
            n = len(snap.tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and prompt[:n] == snap.tokens:
                best = snap
        if best is not None:
            best.last_used = next(self._clock)
        return best

    def would_keep(self, n_tokens: int, nbytes: int) -> bool:
        """Whether a snapshot of `n_tokens` tokens taking about `nbytes` would be stored: reading a slot to the host
        is not free (hundreds of MB at long contexts), so callers ask first."""
        return n_tokens > 0 and 0 < nbytes <= self.budget

    def insert(self, tokens: Sequence[int], state: ModelCache) -> None:
        """Stores a host copy of a slot's state after `tokens` (state as read from the device, batch 1; its KV may
        hold more positions than the tokens: they are cut to whole `kv_block`s past the prefix)."""
        tokens = tuple(tokens)
        if not tokens or self.budget <= 0:
            return
        if tokens in self._snaps:
            self._snaps[tokens].last_used = next(self._clock)
            return
        keep = -(-len(tokens) // self.kv_block) * self.kv_block
        state = map_kv_positions(state, lambda x, axis: np.array(x[_positions(axis, keep)]))
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
        if nbytes > self.budget:
            return
        while self.bytes + nbytes > self.budget:
            oldest = min(self._snaps.values(), key=lambda s: s.last_used)
            self.bytes -= self._snaps.pop(oldest.tokens).nbytes
        self._snaps[tokens] = Snapshot(tokens, state, nbytes, next(self._clock))
        self.bytes += nbytes

    @staticmethod
    def restore(snap: Snapshot, kv_len: int) -> ModelCache:
        """The snapshot's state with KV padded back to the slot cache length."""

        def pad(x, axis):
            out = np.zeros(x.shape[:axis] + (kv_len,) + x.shape[axis + 1 :], x.dtype)
            out[_positions(axis, x.shape[axis])] = x
            return out

        return map_kv_positions(snap.state, pad)
