"""Step inputs uploaded for every call and read by every layer (window lengths `n_valid`, prefill's `slots`) are
read once, by a copy into the step's own memory (`steps.held`): on a GPU each command reading a buffer that moved
since the last call is updated before the step's CUDA graph launches, and these inputs move every call. Checked on
the compiled HLO: the input parameter has a single reader."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import strata_jax
from conftest import FIXTURES
from strata_jax.engine import Engine, EngineConfig, steps
from strata_jax.engine.steps import prefill_args, verify_args

SAMPLING = (np.zeros(2, np.float32), np.zeros(2, np.int32), np.ones(2, np.float32), np.zeros(2, np.uint32))


@pytest.fixture(scope="module")
def runner():
    model = strata_jax.load_model(FIXTURES / "ckpt" / "qwen3_next")
    cfg = EngineConfig(slots=2, max_context=64, prefill_chunks=(16,), prefix_cache_mib=0, draft="ngram", draft_k=2,
                       adaptive_draft=False)
    return Engine(model, cfg)._runner, model


def _readers(hlo: str, op_name: str) -> int:
    """Instructions of the entry computation that take the parameter jax named `op_name` as an operand."""
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    name = next(re.match(r"\s*(%\S+) = ", line).group(1) for line in entry
                if " parameter(" in line and f'op_name="{op_name}"' in line)
    return sum(1 for line in entry if re.search(re.escape(name) + r"[,)]", line.split(" = ", 1)[-1]))


def _hlo(runner, name: str) -> str:
    r, model = runner
    extras = r._extras((2, 3) if name == "verify" else (2,), None, None)
    if name == "verify":
        args = verify_args(np.zeros((2, 3), np.int32), np.array([3, 1], np.int32), SAMPLING, (), model.dtype,
                           **extras)
    else:
        args = prefill_args(np.array([0, 1], np.int32), np.zeros((2, 16), np.int32), np.array([16, 5], np.int32),
                            np.array([-1, -1], np.int32), SAMPLING, (), model.dtype, **extras)
    return r._jitted[name].lower(r._weights(), r.cache, *args).compile().as_text()


@pytest.mark.parametrize("name, arg", [("verify", "rest[2]"), ("prefill", "rest[3]"), ("prefill", "rest[1]")])
def test_window_lengths_and_prefill_slots_are_read_once(runner, name, arg, monkeypatch):
    """verify's n_valid (rest[2]); prefill's n_valid (rest[3]) and slots (rest[1])."""
    jax.clear_caches()  # no trace left from another case's patched `held`
    assert _readers(_hlo(runner, name), arg) == 1
    # Without the copy the layers' fusions read the input itself (what the check above rules out).
    monkeypatch.setattr(steps, "held", lambda x: x)
    jax.clear_caches()  # traced again, without the copy
    assert _readers(_hlo(runner, name), arg) > 1


def test_held_keeps_the_values():
    x = np.array([0, 3, 17, 5], np.int32)
    np.testing.assert_array_equal(np.asarray(steps.held(x)), x)
