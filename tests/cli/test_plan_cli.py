"""`python -m strata_jax plan`: the table and CPU line for the Flash-Next preset, a refusal (exit 3, "does not
fit"), a card named instead of a budget, a CPU without either (a usage error, exit 2, that says to name a card), a
converted directory read from its marker only. The runs start together to keep the test fast."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strata_jax.engine.command_buffers import supports_stable_scratch

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt" / "qwen4_exp_causal"


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "strata_jax", "plan", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    converted = tmp_path_factory.mktemp("converted")
    shutil.copy(FIXTURE / "config.json", converted / "config.json")
    (converted / "strata_quant.json").write_text(json.dumps(
        {"format": "strata_jax-packed-v1", "planes": 2, "group": 64, "dtype": "float32"}))
    procs = {
        "24g": _start("--preset", "flash-next-125b", "--slots", "4", "--ctx", "32768", "--vram-budget-mib", "24576",
                      "--pool-workers", "3"),
        "4g": _start("--preset", "flash-next-125b", "--vram-budget-mib", "4096"),
        "card": _start("--preset", "flash-next-125b", "--card", "24gb", "--slots", "4", "--ctx", "32768"),
        "no card": _start("--preset", "flash-next-125b"),
        "converted": _start("--model", str(converted), "--vram-budget-mib", "1700", "--slots", "2"),
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = (proc.returncode, stdout, stderr)
    return out


def test_preset_at_24_gib(runs):
    rc, out, err = runs["24g"]
    assert rc == 0, err
    assert "memory plan: qwen4_exp, 48 layers, 512 experts/layer (top-10)" in out
    assert "budget 24.00 GiB from --vram-budget-mib 24576" in out
    assert "caches total (4 slots x 32768 tokens)" in out
    assert "of 512 experts per MoE layer on the GPU" in out and "stay in host RAM" in out
    assert "allocator: XLA_PYTHON_CLIENT_PREALLOCATE=false" in out
    # Experts outside the device pool: XLA's default command buffers (stable-scratch not yet measured there).
    assert "command buffers on a GPU (serve --command-buffers auto): xla (" in out
    cpu_line = next(line for line in out.splitlines() if line.startswith("visible CPUs "))
    assert cpu_line.endswith(": 3 pool workers (--pool-workers)")


def test_refusal_exits_3_naming_what_does_not_fit(runs):
    rc, out, err = runs["4g"]
    assert rc == 3
    assert "REFUSED: does not fit" in out
    assert err.startswith("error: does not fit") and "dense weights 9.15 GiB" in err and "larger card" in err


def test_a_named_card_plans_on_a_cpu(runs):
    rc, out, err = runs["card"]
    assert rc == 0, err
    assert "budget 23.99 GiB from --vram-budget-mib 24564" in out
    assert "of 512 experts per MoE layer on the GPU" in out


def test_a_cpu_without_a_card_is_a_usage_error_that_says_what_to_do(runs):
    rc, out, err = runs["no card"]
    assert rc == 2 and out == ""
    assert err.startswith("error: this machine's backend reports no device memory (a CPU?): name the card")
    assert "--card 24gb" in err and "141gb" in err


def test_converted_directory_reads_its_marker_not_its_weights(runs):
    rc, out, err = runs["converted"]  # the directory has no weights at all
    assert rc == 0, err
    assert "weights float32, experts 1-bit, 2 planes, group 64" in out
    # No --ctx: serve's default, the largest context that fits 2 slots in 1,700 MiB (65,536 does not).
    chosen = re.search(r"^context: 2 slots x (\d+) tokens \(plan: the largest that fits", out, re.MULTILINE)
    assert chosen and 1024 <= int(chosen[1]) < 65_536
    assert f"caches total (2 slots x {chosen[1]} tokens)" in out
    want = "stable-scratch" if supports_stable_scratch() else "xla"  # every expert resident: nothing streams
    assert f"command buffers on a GPU (serve --command-buffers auto): {want} (" in out
