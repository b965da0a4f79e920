"""The CPU hang of issue 20, kept as a test: one thread calling the compiled 2,048-token prefill of the demo model (one
slot of 65,536 tokens) must finish every call. jaxlib 0.10.2's XLA:CPU loses the completion of such a call now and
then (README, "When something goes wrong": 4 of 4 runs of `python -m tools.hang_repro --standalone 60` hung within 34
calls under load; 0 of 120 calls with jaxlib 0.11.2), so on 0.10 the test is skipped and `serve` keeps 256-token CPU
chunks; from 0.11 on it guards against the hang coming back."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tools.hang_repro import STANDALONE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11),
                    reason="jaxlib 0.10 has the XLA:CPU hang this test guards against (README)")
def test_long_cpu_prefill_calls_all_finish():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    calls, per_call_limit = 12, 120
    run = subprocess.run([sys.executable, "-c", STANDALONE, str(calls), str(per_call_limit), "2048"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=900 + calls * per_call_limit)
    assert "HUNG" not in run.stdout, run.stdout
    assert f"ok: {calls} calls" in run.stdout, run.stdout + run.stderr[-2000:]
