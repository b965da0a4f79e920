"""Parity with Hugging Face transformers on tiny random checkpoints (tests/fixtures/make_reference_checkpoints.py).

float32 everywhere; the bar is max|ours - ref| / max|ref| <= 1e-4, and identical greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES

CKPTS = ["qwen4_exp_causal", "qwen4_exp_cond", "qwen3_next"]
TOL = 1e-4


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    assert np.all(np.isfinite(ours))
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=CKPTS)
def loaded(request):
    path = FIXTURES / "ckpt" / request.param
    return strata_jax.load_model(path), dict(np.load(path / "reference.npz"))


def test_whole_sequence(loaded):
    model, ref = loaded
    assert _rel(model.logits(ref["input_ids"]), ref["logits"]) <= TOL


def test_eos_inside_sequence(loaded):
    model, ref = loaded
    assert _rel(model.logits(ref["input_ids_eos"]), ref["logits_eos"]) <= TOL


def test_prefill_in_odd_chunks(loaded):
    model, ref = loaded
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], ids.shape[1])
    parts, pos = [], 0
    for size in (7, 13, 1, 19):  # 19 > 16 takes the chunked delta rule from a carried state
        logits, _, seqs = model.step(seqs, ids[:, pos : pos + size])
        parts.append(logits)
        pos += size
    assert pos == ids.shape[1]
    assert _rel(np.concatenate(parts, axis=1), ref["logits"]) <= TOL


def test_token_by_token_decode(loaded):
    model, ref = loaded
    ids = ref["input_ids"]
    seqs = model.start(ids.shape[0], ids.shape[1])
    parts = []
    for t in range(ids.shape[1]):
        logits, _, seqs = model.step(seqs, ids[:, t : t + 1])
        parts.append(logits)
    assert _rel(np.concatenate(parts, axis=1), ref["logits"]) <= TOL


def test_greedy_generation(loaded):
    model, ref = loaded
    out = model.generate([int(t) for t in ref["prompt"][0]], max_new_tokens=16, stop_at_eos=False)
    assert out == [int(t) for t in ref["greedy"]]


def test_padded_rows_match_separate_runs(loaded):
    """Rows of one batch with different numbers of valid tokens advance exactly as if run alone."""
    model, ref = loaded
    ids = ref["input_ids"]
    seqs = model.start(2, ids.shape[1])
    first, _, seqs = model.step(seqs, ids[:, :12], n_valid=np.array([12, 5]))
    # Row 1 only consumed 5 tokens; feed it the rest while row 0 continues.
    rest = np.stack([ids[0, 12:40], np.concatenate([ids[1, 5:33]])])
    second, _, seqs = model.step(seqs, rest, n_valid=np.array([28, 28]))
    assert _rel(first[0], ref["logits"][0, :12]) <= TOL
    assert _rel(first[1, :5], ref["logits"][1, :5]) <= TOL
    assert _rel(second[0], ref["logits"][0, 12:40]) <= TOL
    assert _rel(second[1], ref["logits"][1, 5:33]) <= TOL


def test_mtp_head_matches_reference():
    path = FIXTURES / "ckpt" / "qwen3_next"
    ref = dict(np.load(path / "reference.npz"))
    if "mtp_logits" not in ref:
        pytest.skip("fixture has no MTP reference")
    model = strata_jax.load_model(path)
    assert model.has_mtp
    ids = ref["input_ids"][:1]
    np.testing.assert_array_equal(ref["mtp_input_ids"], ids[:, 1:])  # MTP pairs hidden[t] with token t+1
    seqs = model.start(1, ids.shape[1])
    _, hidden, seqs = model.step(seqs, ids)
    logits, _ = model.mtp_step(seqs, ids[:, 1:], hidden[:, :-1])
    assert _rel(np.asarray(hidden[:, :-1]), ref["mtp_hidden"]) <= TOL
    assert _rel(logits, ref["mtp_logits"]) <= TOL


def test_qwen4_mtp_runs():
    model = strata_jax.load_model(FIXTURES / "ckpt" / "qwen4_exp_causal")
    assert model.has_mtp
    ids = np.arange(1, 11, dtype=np.int32)[None]
    seqs = model.start(1, 10)
    _, hidden, seqs = model.step(seqs, ids)
    logits, _ = model.mtp_step(seqs, ids[:, 1:], hidden[:, :-1])
    assert logits.shape == (1, 9, model.config.vocab_size)
    assert np.all(np.isfinite(logits)) and logits.std() > 0
