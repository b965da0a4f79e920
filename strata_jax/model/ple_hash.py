"""PLE, the host half: the exact n-gram hash of the reference and the row gather from a memory-mapped table.

The table (51B parameters in the real model) never goes to the GPU: its rows depend only on token ids, so they
are gathered here before a step and passed in. Hash: per PLE layer, `ngram_size` odd multipliers derived with
splitmix64 from the seed; an n-gram's id is XOR_i(token_{t-i} * m_i) (int64, wrapping) modulo a distinct prime
per head, plus the head's offset in the concatenated table. Context before the sequence start, or before an
eos within it, reads as eos.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strata_jax.model.config import ModelConfig

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> np.ndarray:
    """The odd hash multipliers of one PLE layer, bounded so token * m fits int64 before wrapping matters."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_PRIME * ple_index
    out = [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]
    return np.array(out, dtype=np.int64)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _nth_prime_after(start: int, count: int) -> int:
    p = start
    for _ in range(count):
        p += 1
        while not _is_prime(p):
            p += 1
    return p


@dataclass(frozen=True)
class NgramHasher:
    """Maps token histories to the table rows of one PLE layer."""

    multipliers: np.ndarray  # [ngram_size] int64
    head_sizes: np.ndarray  # [heads] int64, distinct primes
    head_offsets: np.ndarray  # [heads] int64
    ngram_size: int
    heads_per_ngram: int
    eos_id: int
    table_rows: int  # padded size of the concatenated table

    @classmethod
    def for_layer(cls, cfg: ModelConfig, ple_index: int) -> "NgramHasher":
        """`ple_index` is the position of the layer in `cfg.ple_layers`."""
        heads = cfg.ple_ngram_heads
        sizes = [
            _nth_prime_after(cfg.ngram_vocab_size_base - 1, ple_index * heads + h + 1) for h in range(heads)
        ]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        total = int(np.sum(sizes))
        padded = -(-total // cfg.ngram_vocab_divisor) * cfg.ngram_vocab_divisor
        return cls(
            multipliers=layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.ngram_seed),
            head_sizes=np.array(sizes, dtype=np.int64),
            head_offsets=offsets,
            ngram_size=cfg.ngram_size,
            heads_per_ngram=cfg.heads_per_ngram,
            eos_id=cfg.pad_eos_id,
            table_rows=padded,
        )

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1

    def initial_context(self, batch: int) -> np.ndarray:
        """The context before any token: all eos."""
        return np.full((batch, self.context_len), self.eos_id, dtype=np.int64)

    def row_ids(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Table row ids [B, T, heads] of `tokens` [B, T] preceded by `context` [B, ngram_size-1]."""
        hist = np.concatenate([context, tokens], axis=1).astype(np.int64)
        b, n = hist.shape
        pos = np.arange(n)
        eos_pos = np.where(hist == self.eos_id, pos, -1)
        prev_eos = np.concatenate([np.full((b, 1), -1), np.maximum.accumulate(eos_pos, axis=1)[:, :-1]], axis=1)
        seg_pos = pos[None, :] - (prev_eos + 1)
        shifted = []
        for s in range(self.ngram_size):
            src = np.maximum(pos - s, 0)
            valid = (seg_pos >= s) & ((pos - s) >= 0)[None, :]
            shifted.append(np.where(valid, hist[:, src], self.eos_id))
        blocks = []
        with np.errstate(over="ignore"):
            for order in range(2, self.ngram_size + 1):
                mixed = shifted[0] * self.multipliers[0]
                for i in range(1, order):
                    mixed = mixed ^ (shifted[i] * self.multipliers[i])
                lo = (order - 2) * self.heads_per_ngram
                sizes = self.head_sizes[lo : lo + self.heads_per_ngram]
                blocks.append(np.remainder(mixed[..., None], sizes) + self.head_offsets[lo : lo + self.heads_per_ngram])
        return np.concatenate(blocks, axis=-1)[:, self.context_len :]

    @staticmethod
    def next_context(context: np.ndarray, tokens: np.ndarray, n_valid: Sequence[int] | None = None) -> np.ndarray:
        """The last ngram_size-1 tokens after consuming the first `n_valid[b]` tokens of each row."""
        hist = np.concatenate([context, tokens], axis=1)
        k = context.shape[1]
        if n_valid is None:
            return hist[:, hist.shape[1] - k :].copy()
        return np.stack([hist[r, n : n + k] for r, n in enumerate(n_valid)])


class PleTable:
    """A PLE embedding table kept in host memory, possibly as several (memory-mapped) shards along rows."""

    def __init__(self, shards: Sequence[np.ndarray]):
        if not shards:
            raise ValueError("a PLE table needs at least one shard")
        self.shards = list(shards)
        self.starts = np.cumsum([0] + [s.shape[0] for s in self.shards])
        self.dim = self.shards[0].shape[1]

    @property
    def rows(self) -> int:
        return int(self.starts[-1])

    def gather(self, ids: np.ndarray, dtype: np.dtype = np.float32) -> np.ndarray:
        """Rows for ids [B, T, heads] -> [B, T, heads*dim] (each token's heads concatenated)."""
        flat = ids.reshape(-1)
        out = np.empty((flat.size, self.dim), dtype=dtype)
        shard_of = np.searchsorted(self.starts, flat, side="right") - 1
        for s, shard in enumerate(self.shards):
            sel = np.nonzero(shard_of == s)[0]
            if sel.size:
                out[sel] = shard[flat[sel] - self.starts[s]]
        return out.reshape(*ids.shape[:-1], ids.shape[-1] * self.dim)
