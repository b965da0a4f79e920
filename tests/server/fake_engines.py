"""A scripted engine that also reports what the real engine adds to its events: known log-probabilities (when the
request asks for them) and the slot on the first event. The `serve` fixture (tests/conftest.py) runs the real app over
it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from server_helpers import ScriptedEngine

from strata_jax.engine.protocol import GenerationRequest, TokenLogprob


def known_logprob(i: int) -> float:
    """The log-probability the fake reports for the i-th generated token (exact in binary)."""
    return -(i + 1) / 8


def known_top(token_id: int, i: int, k: int, vocab: int) -> tuple[tuple[int, float], ...]:
    """The fake's k most likely tokens at step i: the chosen one first, then the next ids, each 1 nat less likely."""
    return tuple(((token_id + j) % vocab, known_logprob(i) - j) for j in range(k))


class LogprobEngine(ScriptedEngine):
    """`ScriptedEngine` whose events carry `TokenLogprob`s (token i: `known_logprob(i)`, alternatives
    `known_top`) when `sampling.logprobs` is set, and `slot` on the first event. `minus_inf_at`: the step whose
    logprob is -inf (a token the model gave no probability)."""

    def __init__(self, *args: Any, slot: int = 2, minus_inf_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot = slot
        self.minus_inf_at = minus_inf_at

    async def submit(self, request: GenerationRequest) -> Any:
        stream = await super().submit(request)
        k = request.sampling.logprobs
        vocab = self.tokenizer.vocab_size

        async def events() -> Any:
            i = 0
            async for event in stream:
                extra: dict[str, Any] = {"slot": self.slot} if i == 0 else {}
                if k is not None and event.token_id is not None:
                    lp = -math.inf if i == self.minus_inf_at else known_logprob(i)
                    extra["logprobs"] = (TokenLogprob(event.token_id, lp, known_top(event.token_id, i, k, vocab)),)
                i += 1
                yield dataclasses.replace(event, **extra)

        return events()

