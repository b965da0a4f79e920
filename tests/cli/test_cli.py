"""The command line as a user runs it."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES


def _run(*args):
    return subprocess.run([sys.executable, "-m", "strata_jax", *args], capture_output=True, text=True, timeout=600)


def test_generate_prints_text():
    res = _run("generate", "--model", str(FIXTURES / "ckpt" / "qwen3_next"), "--prompt", "def add(a, b):",
               "--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "generated" in res.stderr


def test_generate_chat_prints_the_answer_without_its_end_of_turn_token():
    res = _run("generate", "--chat", "--prompt", "hi", "--max-tokens", "80")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() and "<|im_end|>" not in res.stdout and "<|endoftext|>" not in res.stdout


def test_bare_command_and_console_script_print_help():
    res = _run()
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m strata_jax") and not res.stderr
    script = shutil.which("strata-jax", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the strata-jax console script is not installed next to this Python (pip install -e .)")
    res = subprocess.run([script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.startswith("usage: strata-jax")
    assert subprocess.run([script, "--version"], capture_output=True, text=True, timeout=600).stdout.strip() == \
        "strata_jax 0.1.0"


def test_help_and_bad_input():
    assert "generate" in _run("--help").stdout
    res = _run("generate", "--model", "/no/such/dir", "--prompt", "x")
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = _run("generate", "--prompt", "x", "--max-tokens", "0")
    assert res.returncode == 2 and "max-tokens" in res.stderr
