"""The numba host experts against the float64 dequantize-and-matmul reference of test_host_experts (table and dense
paths, 1 and 2 planes, odd token counts, groups 64 and 128, poisoned padding), the tier's kernel choice and its
fallback, and a model with a host tier computed by numba against all experts resident."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import FIXTURES
from test_host_experts import REFERENCE_CASES, _dense64, _packed, _reference64, numpy_stack, reference_case

import strata_jax
from pallas_kernels.onebit_format import PackedExperts, words_to_bytes
from strata_jax.host import tier as host_tier
from strata_jax.host.experts_numba import DENSE_MIN_TOKENS, NumbaStack, host_experts_numba, numba_available
from strata_jax.host.experts_numpy import host_experts
from strata_jax.host.pool import HostPool, default_kernel

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


def _numba_stack(gb, gs, db, ds, group) -> NumbaStack:
    return NumbaStack(PackedExperts(words_to_bytes(gb), gs, group, "bytes"),
                      PackedExperts(words_to_bytes(db), ds, group, "bytes"))


def _close(got, ref):
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("e,planes,hidden,inter,group,tokens,k", REFERENCE_CASES)  # the last: the dense path
def test_matches_float64_reference(e, planes, hidden, inter, group, tokens, k):
    (gb, gs, db, ds), x, ids, w, mask, ref = reference_case(e, planes, hidden, inter, group, tokens, k)
    got = host_experts_numba(_numba_stack(gb, gs, db, ds, group), x, ids, w, mask, threads=2)
    _close(got, ref)
    assert np.all(got[~mask.any(axis=1)] == 0)


# (planes, hidden, intermediate, group, tokens): 1 and 2 planes, odd token counts, groups 64 and 128, short last
# groups (320 inputs in groups of 128, 96 in groups of 64 or 128), and enough tokens on one expert for the dense path.
CASES = [(1, 320, 96, 64, 1), (2, 320, 96, 128, 3), (1, 256, 160, 128, 5), (2, 192, 96, 64, 7),
         (2, 320, 96, 128, DENSE_MIN_TOKENS + 3)]


@pytest.mark.parametrize("planes,hidden,inter,group,tokens", CASES)
def test_poisoned_padding_and_mixed_paths(planes, hidden, inter, group, tokens):
    """Rows without a host pair hold NaN and their masked-out slots name experts that do not exist: neither may reach
    the output. Expert 0 takes every real token (the dense path once there are DENSE_MIN_TOKENS of them), the others
    a few each (tables), all in one call."""
    rng = np.random.default_rng(tokens * 10 + planes)
    e, k = 6, 3
    gb, gs = _packed(rng, e, planes, hidden, 2 * inter, group)
    db, ds = _packed(rng, e, planes, inter, hidden, group)
    rows = tokens + 2  # two padding rows, poisoned
    x = rng.normal(size=(rows, hidden)).astype(np.float32)
    ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, e), k - 1, replace=False)]) for _ in range(rows)])
    w = rng.uniform(size=(rows, k)).astype(np.float32)
    mask = rng.uniform(size=(rows, k)) < 0.5
    mask[:, 0] = True
    pad = [1, rows - 1]
    x[pad] = np.nan
    ids[pad] = [99, -7, 1 << 30]
    w[pad] = np.nan
    mask[pad] = False
    ref = _reference64(x.astype(np.float64), ids.clip(0, e - 1), w, mask, _dense64(gb, gs, group),
                       _dense64(db, ds, group))
    stack = _numba_stack(gb, gs, db, ds, group)
    got = host_experts_numba(stack, x, ids, w, mask, threads=2)
    assert np.all(np.isfinite(got)) and np.all(got[pad] == 0)
    _close(got, ref)
    # Work items never share an output, so the thread count cannot change a bit of it.
    assert np.array_equal(host_experts_numba(stack, x, ids, w, mask, threads=1), got)


def test_agrees_with_the_numpy_kernel():
    (gb, gs, db, ds), x, ids, w, mask, ref = reference_case(*REFERENCE_CASES[1])
    group = REFERENCE_CASES[1][4]
    got = host_experts_numba(_numba_stack(gb, gs, db, ds, group), x, ids, w, mask)
    numpy = host_experts(numpy_stack(gb, gs, db, ds, group), x, ids, w, mask)
    np.testing.assert_allclose(got, numpy, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_no_pairs_gives_zeros():
    rng = np.random.default_rng(1)
    gb, gs = _packed(rng, 3, 1, 64, 64, 64)
    db, ds = _packed(rng, 3, 1, 32, 64, 64)
    out = host_experts_numba(_numba_stack(gb, gs, db, ds, 64), np.ones((2, 64), np.float32), np.zeros((2, 1), int),
                             np.ones((2, 1)), np.zeros((2, 1), bool))
    assert out.shape == (2, 64) and not out.any()


def _tier(kernel, arrays):
    t = host_tier.HostTier(64, HostPool(kernel=kernel, workers=2))
    for name, array in zip(t._KINDS, arrays):
        t.set(name, array)
    return t


def test_tier_selects_numba_and_falls_back_without_it(monkeypatch):
    rng = np.random.default_rng(3)
    arrays = (*_packed(rng, 5, 1, 128, 64, 64), *_packed(rng, 5, 1, 32, 128, 64))
    x = rng.normal(size=(3, 128)).astype(np.float32)
    ids = np.asarray([[0, 4], [1, 2], [3, 4]], np.int32)
    w = rng.uniform(size=(3, 2)).astype(np.float32)
    mask = np.asarray([[True, False], [True, True], [False, True]])
    assert default_kernel() == "numba"
    tier = _tier("numba", arrays)
    tier.warm_up(4)
    assert tier.kernel == "numba" and isinstance(tier.stack, NumbaStack)
    got = tier.compute(x, ids, w, mask)
    np.testing.assert_allclose(got, _tier("numpy", arrays).compute(x, ids, w, mask), rtol=1e-4,
                               atol=1e-5 * np.abs(got).max())
    assert tier.pool.busy()[0] == 1
    # Without numba: a one-line warning and the xla kernel; switching to numba explicitly is refused.
    monkeypatch.setattr(host_tier, "numba_available", lambda: False)
    with pytest.warns(UserWarning, match="fall back to the xla kernel"):
        fallback = _tier("numba", arrays)
    assert fallback.kernel == "xla"
    np.testing.assert_allclose(fallback.compute(x, ids, w, mask), got, rtol=1e-4, atol=1e-5 * np.abs(got).max())
    with pytest.raises(RuntimeError, match="needs numba"):
        fallback.use_kernel("numba")


CKPT = FIXTURES / "ckpt" / "qwen4_exp_causal"  # 8 experts per layer, top-4
PROMPT = [5, 17, 300, 42, 9, 77, 123, 8, 250, 31]


def test_model_with_a_numba_host_tier_matches_all_resident():
    """A quarter of the experts on the device, the rest computed by numba: the same logits (prompt chunk and
    decode) and greedy tokens as every expert resident."""
    resident = strata_jax.load_model(CKPT, quantize="1bit", group=64)
    split = strata_jax.load_model(CKPT, quantize="1bit", group=64, gpu_experts=2, host_kernel="numba")
    assert split.host_pool.kernel == "numba"
    ids = np.asarray([PROMPT + PROMPT[:6], PROMPT[::-1] + PROMPT[:6]], np.int32)
    a, b = resident.logits(ids), split.logits(ids)
    tol = 1e-4 if jax.default_backend() == "cpu" else 1e-2
    assert np.abs(a - b).max() <= tol * np.abs(a).max()
    assert split.generate(PROMPT, 8, stop_at_eos=False) == resident.generate(PROMPT, 8, stop_at_eos=False)


def test_parallel_calls_run_on_openmp_where_libgomp_loads():
    """Without NUMBA_THREADING_LAYER the kernel's parallel calls pick OpenMP (2-4x faster per layer than numba's
    workqueue, docs/PERF.md) where numba's OpenMP pool loads, else the workqueue; the environment variable still
    decides when set. Fresh processes: a threading layer is fixed by a process's first parallel call."""
    import os
    import subprocess
    import sys

    body = ("import numpy as np\n"
            "from test_host_numba import _numba_stack\n"
            "from test_host_experts import reference_case\n"
            "from strata_jax.host.experts_numba import host_experts_numba, threading_layer\n"
            "(gb, gs, db, ds), x, ids, w, mask, ref = reference_case(*REF[:7])\n"
            "got = host_experts_numba(_numba_stack(gb, gs, db, ds, REF[4]), x, ids, w, mask, threads=2)\n"
            "assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())\n"
            "print(threading_layer())\n")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))])

    def layer(**env_extra) -> str:
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"} | env_extra
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        code = f"REF = {REFERENCE_CASES[0]!r}\n" + body
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    try:
        import numba.np.ufunc.omppool  # noqa: F401
        expected = "omp"
    except ImportError:
        expected = "workqueue"
    assert layer() == expected
    assert layer(NUMBA_THREADING_LAYER="workqueue") == "workqueue"
