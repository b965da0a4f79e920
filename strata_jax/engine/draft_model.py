"""A separate small draft model (same tokenizer) as the drafter for every slot.

The draft model keeps its own slot caches. Before each verify it catches up on the tokens the target consumed
since the last step (chunked prefill of that slot), then one jitted call decodes k greedy tokens for every slot at
once; the cache that call produces is thrown away (the function is pure), so nothing needs rolling back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.loaded_model import LoadedModel
from strata_jax.engine.config import MAX_MODEL_DRAFT_K, EngineConfig
from strata_jax.engine.drafters import DraftRequest
from strata_jax.engine.runner import ModelRunner, RunnerModel


def _draft_k(k, graphdef, state, cache, last, active):
    model = nnx.merge(graphdef, state)
    n_valid = active.astype(jnp.int32)

    def step(carry, _):
        c, token = carry
        logits, _, c = model(token[:, None], c, n_valid)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (c, nxt), nxt

    _, drafts = jax.lax.scan(step, (cache, last), None, length=k)
    return drafts.T


class DraftModelDrafter:
    """Drafts with a small model of the same vocabulary (a `Drafter`): one call serves every decoding slot."""

    def __init__(self, draft: LoadedModel, config: EngineConfig, target_vocab: int):
        if draft.config.ple_layers:
            raise ValueError("draft models with PLE layers are not supported yet (their rows depend on drafts)")
        if draft.config.vocab_size > target_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) exceeds the target's")
        if config.draft_k > MAX_MODEL_DRAFT_K:
            raise ValueError(f"draft_k {config.draft_k} is too long for a draft model (at most {MAX_MODEL_DRAFT_K}: "
                             "it runs one forward pass per drafted token)")
        self.k = config.draft_k
        self.runner = ModelRunner(RunnerModel.of(draft), dataclasses.replace(config, draft="none", prefix_cache_mib=0))
        self._draft = jax.jit(functools.partial(_draft_k, self.k, draft.graphdef))
        self._synced = [0] * config.slots
        self._owner: list[object | None] = [None] * config.slots
        self._greedy = ([0.0], [0], [1.0], [0])

    def warm_up(self) -> None:
        """Compiles the draft model's prefill steps and the k-token draft call."""
        self.runner.warm_up()
        s = self.runner.config.slots
        self._draft(self.runner.model.state, self.runner.cache, jnp.zeros(s, jnp.int32), jnp.zeros(s, bool))

    def _catch_up(self, slot: int, owner: object, consumed: Sequence[int]) -> None:
        if self._owner[slot] is not owner or self._synced[slot] > len(consumed):
            self.runner.reset(slot)
            self._owner[slot], self._synced[slot] = owner, 0
        chunks = self.runner.config.prefill_chunks
        while self._synced[slot] < len(consumed):
            todo = consumed[self._synced[slot] :]
            size = next((c for c in chunks if c >= len(todo)), chunks[-1])
            n = min(size, len(todo))
            tokens = np.zeros((1, size), np.int32)
            tokens[0, :n] = todo[:n]
            self.runner.prefill([slot], tokens, [n], [-1], (), self._greedy)
            self._synced[slot] += n

    def propose(self, requests: Mapping[int, DraftRequest]) -> dict[int, list[int]]:
        """Up to `limit` greedy drafts per slot, after catching each slot up on the tokens the target consumed
        (all of its history but the last token)."""
        s = self.runner.config.slots
        last = np.zeros(s, np.int32)
        active = np.zeros(s, bool)
        for slot, r in requests.items():
            self._catch_up(slot, r.owner, r.history[:-1])
            last[slot], active[slot] = r.history[-1], True
        drafts = np.asarray(self._draft(self.runner.model.state, self.runner.cache, jnp.asarray(last),
                                        jnp.asarray(active)))
        return {slot: [int(t) for t in drafts[slot, : max(r.limit, 0)]] for slot, r in requests.items()}
