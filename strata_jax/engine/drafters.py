"""Drafters for speculative decoding, behind one interface: each step the scheduler asks the drafter once for every
decoding slot's guesses, and the verify step checks them all (strata_jax/engine/speculative.py keeps the output
exact). `EngineConfig.draft` picks a built-in one (`make_drafter`); `Engine(..., drafter=...)` takes any other
(e.g. a draft model, strata_jax/engine/draft_model.py, or the benchmarks' oracle, strata_jax/bench/oracle.py). How
many tokens each slot asks for is the scheduler's (`EngineConfig.draft_k`, `adaptive_draft`).

A drafter that can also guess on the device (`DeviceDrafter`: the MTP head, the benchmarks' oracle) lets the
scheduler chain verify windows (`EngineConfig.chain_windows`): window n+1 is launched from window n's outputs
while they are still on the device, before the host reads window n back, as overlapped decode does for plain steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from strata_jax.engine.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One decoding slot's request for drafts.

    owner: identifies the request (a drafter that keeps per-slot state starts over when a slot's owner changes).
    history: the whole sequence so far, prompt + generated; the target model has consumed all but its last token.
    limit: the most drafts to propose now: the slot's draft length this step (strata_jax/engine/draft_policy.py:
        it follows the slot's acceptance) cut to what can still be emitted (may be <= 0: then none). Longer
        proposals are cut to it.
    device_drafts: the guesses of the checkpoint's MTP head computed by the last step (empty without MTP).
    """

    owner: object
    history: Sequence[int]
    limit: int
    device_drafts: Sequence[int] = ()


@runtime_checkable
class Drafter(Protocol):
    """Guesses the next tokens of every decoding slot at once."""

    def propose(self, requests: Mapping[int, DraftRequest]) -> dict[int, list[int]]:
        """slot -> up to `requests[slot].limit` guessed next tokens (a slot may be missing or get [] for none)."""
        ...

    def warm_up(self) -> None:
        """Compiles whatever the drafter runs (called once, before serving)."""
        ...


@runtime_checkable
class DeviceDrafter(Drafter, Protocol):
    """A `Drafter` that can also guess on the device, from the device's own view of every slot (the sequence
    lengths and the last step's MTP guesses), so that verify windows chain without the host in between.

    Host side: `bind` once, `device_ready` when a chain starts, `device_state` at each chained window (its arrays
    go into the window's inputs), `observe` when a chained window is read back. Device side: `device_drafts`, a
    pure function traced into the jitted window inputs (strata_jax/engine/speculative.py, `window_inputs`)."""

    def bind(self, slots: int, max_context: int) -> None:
        """The engine's slot count and context length (called once, before serving)."""
        ...

    def device_ready(self, slot: int, owner: object, history: Sequence[int]) -> bool:
        """Prepares `slot`'s device-side state for the request `owner` whose sequence is `history` (the target has
        consumed all but its last token); False: this slot drafts nothing in chained windows."""
        ...

    def device_state(self) -> Any:
        """The pytree of device arrays `device_drafts` reads (uploaded only when it changed)."""
        ...

    def device_drafts(self, state: Any, step_drafts: jax.Array, lengths: jax.Array,
                      k: int) -> tuple[jax.Array, jax.Array]:
        """Traced: guesses [S, k] (int32) for each slot's history positions lengths[s] .. lengths[s] + k - 1, and
        how many of them are real [S]. `step_drafts` [S, m]: the MTP guesses of the window before (m may be 0)."""
        ...

    def observe(self, slot: int, owner: object, start: int, emitted: Sequence[int], proposed: int,
                accepted: int) -> None:
        """A chained window read back: `proposed` drafts, `accepted` of them, and the tokens `emitted`, which are
        history positions start, start + 1, ...."""
        ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_n down to min_n) in the
    sequence and propose what followed it. Free, and strong on code edits where text is copied back."""

    def __init__(self, k: int = 4, max_n: int = 3, min_n: int = 1, window: int = 8192):
        self.k, self.max_n, self.min_n, self.window = k, max_n, min_n, window

    def propose(self, requests: Mapping[int, DraftRequest]) -> dict[int, list[int]]:
        """Each slot's lookup continuation (`propose_one`)."""
        return {slot: self.propose_one(r.history, r.limit) for slot, r in requests.items()}

    def propose_one(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to min(k, limit) guessed next tokens for the sequence `history`."""
        limit = min(self.k, limit)
        if limit <= 0 or len(history) < 2:
            return []
        hist = list(history[-self.window :])
        for n in range(min(self.max_n, len(hist) - 1), self.min_n - 1, -1):
            tail = hist[-n:]
            for start in range(len(hist) - n - 1, -1, -1):
                if hist[start : start + n] == tail:
                    return hist[start + n : start + n + limit]
        return []

    def warm_up(self) -> None:
        """Nothing to compile."""


class MtpDrafter:
    """The checkpoint's own MTP head: its guesses come back with every step (`EngineConfig.draft="mtp"` makes the
    runner chain it `draft_k` times inside each step), so proposing just hands them over."""

    def propose(self, requests: Mapping[int, DraftRequest]) -> dict[int, list[int]]:
        """Each slot's device guesses, cut to its limit."""
        return {slot: list(r.device_drafts[: max(r.limit, 0)]) for slot, r in requests.items()}

    def warm_up(self) -> None:
        """Nothing to compile: the guesses are part of the step functions."""

    # -- on the device (`DeviceDrafter`): the verify step's own MTP guesses ----------------------------------------
    def bind(self, slots: int, max_context: int) -> None:
        """Nothing to size."""

    def device_ready(self, slot: int, owner: object, history: Sequence[int]) -> bool:
        """Every slot has the MTP head's guesses."""
        return True

    def device_state(self) -> tuple:
        """No state: the guesses are the step's outputs."""
        return ()

    def device_drafts(self, state: tuple, step_drafts: jax.Array, lengths: jax.Array,
                      k: int) -> tuple[jax.Array, jax.Array]:
        """The window before's MTP guesses, cut (or padded) to `k`."""
        s, m = step_drafts.shape
        drafts = jnp.zeros((s, k), jnp.int32).at[:, : min(m, k)].set(step_drafts[:, :k].astype(jnp.int32))
        return drafts, jnp.full((s,), min(m, k), jnp.int32)

    def observe(self, slot: int, owner: object, start: int, emitted: Sequence[int], proposed: int,
                accepted: int) -> None:
        """Nothing to keep."""


def make_drafter(config: EngineConfig) -> Drafter | None:
    """The built-in drafter `config.draft` names; None for "none" (no speculation)."""
    if config.draft == "ngram":
        return NgramDrafter(k=config.draft_k)
    if config.draft == "mtp":
        return MtpDrafter()
    return None
