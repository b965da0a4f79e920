"""The step benchmark's inputs and its MTP draft call (`--mode step`, strata_jax/bench/main.py).

With PLE (`--ple`, the default for a preset: strata_jax/bench/synthetic.py) every step's inputs include the n-gram
rows of its tokens, gathered on the host from the PLE table as the engine's executor gathers them; the timed loop
that reads each step's tokens back gathers the next step's rows from them, so it pays what the engine pays (hash,
gather, copy to the device) between two steps. With MTP (`--mtp`), verify chains the MTP head draft_k times as the
engine's verify does under `--draft mtp`, and the draft call alone (`mtp_draft_step`: the pairs of one decoded
token entered into the MTP cache, then k chained guesses) is timed as its own row.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.bench.synthetic import SyntheticPle
from strata_jax.engine.constraints import mask_words
from strata_jax.engine.steps import decode_args, greedy_sampling, verify_args
from strata_jax.model.config import ModelConfig


def mtp_draft_step(mtp_k, graphdef, state, cache, hidden, tokens, n_valid):
    """The MTP drafter's own work in a step: hidden [S, 1, H] of the token just decoded and the token sampled after
    it [S, 1] enter the MTP cache, then the head is chained mtp_k times. Returns (drafts [S, mtp_k], cache)."""
    model = nnx.merge(graphdef, state)
    drafts, cache = model.mtp_drafts(hidden, tokens, cache, n_valid, mtp_k)
    return drafts, cache


STEP_EXTRAS = ("off", "idle", "mask", "logprobs", "both")


def step_extras(cfg: ModelConfig, slots: int, window: int | None, extras: str) -> dict:
    """The optional grammar-mask and log-probability inputs of a decode (`window` None) or verify call, as
    `decode_args` / `verify_args` take them: "off" none (the step before constrained decoding existed), "idle"
    both present and doing nothing (what the engine passes when no slot is constrained or asked), "mask" slot 0
    constrained to half the vocabulary, "logprobs" slot 0 asking, "both"."""
    if extras == "off":
        return {}
    shape = (slots,) if window is None else (slots, window)
    mask = np.full(shape + (mask_words(cfg.vocab_size),), -1, np.int32)
    if extras in ("mask", "both"):
        mask[0] = np.random.default_rng(0).integers(-(2**31), 2**31, mask[0].shape, dtype=np.int64).astype(np.int32)
    wanted = np.zeros(slots, bool)
    wanted[0] = extras in ("logprobs", "both")
    return {"mask": mask, "logprobs": wanted}


class StepInputs:
    """Inputs of the benchmark's decode ("decode"), verify ("verify", windows of `window` tokens) and MTP draft
    ("mtp") calls for `slots` slots. `ple`: host PLE tables (a model with PLE layers): rows gathered for every
    input built; `host_ms` collects the seconds each gather took (ms). `extras`: the grammar-mask and
    log-probability inputs (`step_extras`)."""

    def __init__(self, cfg: ModelConfig, kind: str, slots: int, window: int, dtype, ple_tables=(),
                 extras: str = "off"):
        self.cfg, self.kind, self.slots, self.window, self.dtype = cfg, kind, slots, window, dtype
        self.extras = {} if kind == "mtp" else step_extras(cfg, slots, None if kind == "decode" else window, extras)
        self.ple = SyntheticPle(cfg, list(ple_tables), slots) if cfg.ple_layers else None
        self.rng = np.random.default_rng(slots)
        self.host_ms: list[float] = []

    def first(self) -> tuple:
        """The inputs of the first call (random tokens)."""
        return self.build(self.rng.integers(0, self.cfg.vocab_size, self.slots))

    def build(self, tokens: np.ndarray) -> tuple:
        """The inputs of a call after one whose tokens [S] were `tokens`: decode feeds them, verify starts its
        windows with them (random drafts after), the MTP call pairs them with random hidden states."""
        s, cfg = self.slots, self.cfg
        tokens = np.asarray(tokens, np.int64).reshape(s, -1)[:, :1] % cfg.vocab_size
        if self.kind == "mtp":
            hidden = jnp.asarray(self.rng.normal(0.0, 1.0, (s, 1, cfg.hidden_size)), self.dtype)
            return hidden, jnp.asarray(tokens, jnp.int32), jnp.ones(s, jnp.int32)
        if self.kind == "decode":
            window = tokens
        else:
            drafts = self.rng.integers(0, cfg.vocab_size, (s, self.window - 1))
            window = np.concatenate([tokens, drafts], axis=1)
        rows = self._rows(window)
        if self.kind == "decode":
            return decode_args(window[:, 0], np.ones(s, bool), greedy_sampling(s), rows, self.dtype, **self.extras)
        return verify_args(window, np.full((s,), self.window), greedy_sampling(s), rows, self.dtype, **self.extras)

    def _rows(self, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
        if self.ple is None:
            return ()
        if not self.ple.tables:  # compiling only: shapes, no table
            dim = self.cfg.ple_embed_dim
            return tuple(np.zeros((*tokens.shape, dim), np.float32) for _ in self.cfg.ple_layers)
        t0 = time.perf_counter()
        rows = self.ple.rows(tokens)
        self.host_ms.append((time.perf_counter() - t0) * 1e3)
        return rows


def mtp_bytes(state: nnx.State, cfg: ModelConfig, k: int) -> int:
    """Bytes an MTP draft call of k chained guesses must read at least: the MTP head's weights once and the LM
    head (or tied embedding) once per guess (its KV cache aside)."""
    mtp = sum(x.nbytes for x in jax.tree_util.tree_leaves(state["mtp"]))
    head = state["model"]["embed_tokens"] if cfg.tie_word_embeddings else state["lm_head"]
    return mtp + k * sum(x.nbytes for x in jax.tree_util.tree_leaves(head))
