"""The command line as a user runs it."""

import subprocess
import sys

from conftest import FIXTURES


def _run(*args):
    return subprocess.run([sys.executable, "-m", "strata_jax", *args], capture_output=True, text=True, timeout=600)


def test_generate_prints_text():
    res = _run("generate", "--model", str(FIXTURES / "ckpt" / "qwen3_next"), "--prompt", "def add(a, b):",
               "--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "generated" in res.stderr


def test_help_and_bad_input():
    assert "generate" in _run("--help").stdout
    res = _run("generate", "--model", "/no/such/dir", "--prompt", "x")
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = _run("generate", "--prompt", "x", "--max-tokens", "0")
    assert res.returncode == 2 and "max-tokens" in res.stderr
