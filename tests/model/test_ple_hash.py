"""PLE n-gram hashing against a plain-Python re-statement of the reference's rule (Python ints, explicit int64
wrap-around), and the sharded table gather."""

import numpy as np

from conftest import FIXTURES
from strata_jax.model.config import load_config
from strata_jax.model.ple_hash import NgramHasher, PleTable


def _wrap64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _python_ids(h: NgramHasher, seq: list[int]) -> list[list[int]]:
    """Row ids of each token of `seq` (a whole sequence from its start)."""
    out = []
    for p in range(len(seq)):
        def tok(shift):
            src = p - shift
            if src < 0 or any(seq[j] == h.eos_id for j in range(src, p)):
                return h.eos_id
            return seq[src]

        ids = []
        for order in range(2, h.ngram_size + 1):
            mixed = _wrap64(tok(0) * int(h.multipliers[0]))
            for i in range(1, order):
                mixed = _wrap64(mixed ^ _wrap64(tok(i) * int(h.multipliers[i])))
            lo = (order - 2) * h.heads_per_ngram
            for head in range(lo, lo + h.heads_per_ngram):
                ids.append(mixed % int(h.head_sizes[head]) + int(h.head_offsets[head]))
        out.append(ids)
    return out


def test_hash_matches_python_reference_with_eos_and_chunks():
    cfg = load_config(FIXTURES / "ckpt" / "qwen4_exp_causal")
    h = NgramHasher.for_layer(cfg, 0)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, cfg.vocab_size, 30).tolist()
    seq[9] = seq[10] = h.eos_id
    seq[20] = h.eos_id
    want = np.array(_python_ids(h, seq))
    # Fed in pieces, carrying the context like the engine does.
    ctx, got = h.initial_context(1), []
    for lo, hi in [(0, 1), (1, 10), (10, 11), (11, 30)]:
        tokens = np.array([seq[lo:hi]])
        got.append(h.row_ids(ctx, tokens)[0])
        ctx = h.next_context(ctx, tokens)
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert want.max() < h.table_rows


def test_head_sizes_are_distinct_primes():
    cfg = load_config(FIXTURES / "ckpt" / "qwen4_exp_causal")
    h = NgramHasher.for_layer(cfg, 0)
    sizes = [int(s) for s in h.head_sizes]
    assert sizes == sorted(set(sizes)) and sizes[0] > cfg.ngram_vocab_size_base - 1
    assert all(all(s % d for d in range(2, int(s**0.5) + 1)) for s in sizes)


def test_table_gather_across_shards():
    full = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    table = PleTable([full[:15], full[15:31], full[31:]])
    ids = np.array([[[0, 14, 15, 39], [30, 31, 2, 16]]])
    got = table.gather(ids)
    np.testing.assert_array_equal(got, full[ids].reshape(1, 2, 12))
