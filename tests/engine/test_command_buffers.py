"""XLA's command-buffer mode (strata_jax/engine/command_buffers.py): chosen before JAX starts, never where it
cannot work, accepted by the installed jaxlib; and on a GPU, `serve` under it answers as under XLA's default."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from strata_jax.engine import command_buffers as cb

ROOT = Path(__file__).resolve().parents[2]
NEW, OLD = "0.11.2", "0.10.2"


def test_auto_picks_stable_scratch_only_on_a_gpu_without_a_host_tier():
    assert cb.choose_mode("auto", "gpu", False, {}, NEW)[0] == "stable-scratch"
    mode, why = cb.choose_mode("auto", "gpu", True, {}, NEW)
    assert mode == "xla" and "outside the device pool" in why
    assert cb.choose_mode("auto", "cpu", False, {}, NEW) == ("xla", "no CUDA graphs on the cpu backend")
    assert cb.choose_mode("auto", None, False, {}, NEW)[0] == "xla"
    mode, why = cb.choose_mode("auto", "gpu", False, {}, OLD)
    assert mode == "xla" and "0.11" in why
    # Upstream renamed the flag's values after 0.11: a jaxlib we have not measured keeps XLA's default.
    assert cb.choose_mode("auto", "gpu", False, {}, "0.12.0")[0] == "xla"


def test_a_flag_the_user_set_wins_and_explicit_modes_are_checked():
    env = {"XLA_FLAGS": "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"}
    assert cb.choose_mode("stable-scratch", "gpu", False, env, NEW)[0] == "xla"
    assert cb.choose_mode("xla", "gpu", False, {}, NEW)[0] == "xla"
    assert cb.choose_mode("stable-scratch", "cpu", False, {}, NEW)[0] == "stable-scratch"
    mode, why = cb.choose_mode("stable-scratch", "gpu", True, {}, NEW)  # runs, said to be unmeasured
    assert mode == "stable-scratch" and "not yet measured" in why
    with pytest.raises(ValueError, match="only jax 0.11"):
        cb.choose_mode("stable-scratch", "gpu", False, {}, OLD)
    with pytest.raises(ValueError, match="expected one of"):
        cb.choose_mode("fast", "gpu", False, {}, NEW)


def test_installed_backend_reads_jax_platforms_and_the_cuda_plugin(monkeypatch):
    import importlib.metadata

    assert cb.installed_backend({"JAX_PLATFORMS": "cpu"}) == "cpu"

    class Plugin:
        metadata = {"Name": "jax-cuda13-plugin"}

    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [*real(), Plugin()])
    assert cb.installed_backend({}) == "gpu"
    assert cb.installed_backend({"JAX_PLATFORMS": "cuda"}) == "gpu"


def test_apply_appends_to_existing_flags():
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    cb.apply_mode("stable-scratch", env)
    assert env["XLA_FLAGS"] == "--xla_gpu_autotune_level=0 --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    env = {}
    cb.apply_mode("xla", env)
    assert env == {}
    line = cb.configure("auto", "gpu", False, env) if cb.supports_stable_scratch() else None
    if line is not None:
        assert line.startswith("command buffers: stable-scratch") and "SKIP_TEMP" in env["XLA_FLAGS"]


def test_the_installed_jaxlib_accepts_what_auto_would_set():
    """An XLA flag the jaxlib does not know (or a value it does not) aborts JAX at start-up: run a jitted function
    in a fresh process with exactly what `apply_mode` sets where this jaxlib is said to support it."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
    if not cb.supports_stable_scratch():
        pytest.skip(f"jaxlib {jax.__version__}: auto never sets the flag here (only jax 0.11 takes it)")
    cb.apply_mode("stable-scratch", env)
    code = "import jax, jax.numpy as jnp; print(int(jax.jit(lambda x: (x * 2).sum())(jnp.arange(4))))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "12"


def test_bench_applies_it_before_jax_starts():
    """The bench settles the mode from its own arguments before anything else (its line comes before an argument
    error found later): tier mode leaves experts outside the device pool, so "auto" keeps XLA's default."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-m", "strata_jax.bench", "--mode", "tier", "--draft", "oracle:2"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    reason = "outside the device pool" if cb.supports_stable_scratch() else "only jax 0.11"
    assert re.search(r"command buffers: xla \(.*" + reason, done.stderr), done.stderr[-2000:]
    assert done.stderr.index("command buffers:") < done.stderr.index("P must be in [0, 1]")


@pytest.mark.gpu
def test_serve_answers_the_same_under_stable_scratch(tmp_path):
    """On a GPU: `serve` (the demo checkpoint) chooses stable-scratch by itself and its greedy answer equals the one
    under XLA's default mode."""
    if not cb.supports_stable_scratch():
        pytest.skip(f"jaxlib {jax.__version__}: stable-scratch is only known to work with jax 0.11")
    import httpx

    answers = {}
    for mode in ("auto", "xla"):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("XLA_FLAGS", None)
        proc = subprocess.Popen([sys.executable, "-m", "strata_jax", "serve", "--port", "0", "--slots", "1", "--ctx",
                                 "512", "--command-buffers", mode], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        seen, url = [], None
        try:
            for line in proc.stdout:
                seen.append(line)
                if m := re.search(r"^listening on (http://\S+)$", line.strip()):
                    url = m.group(1)
                    break
            assert url, "".join(seen)
            chosen = [line for line in seen if line.startswith("command buffers:")]
            assert chosen and chosen[0].startswith("command buffers: " + ("stable-scratch" if mode == "auto"
                                                                          else "xla")), "".join(seen)
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "x", "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}]})
            assert r.status_code == 200, r.text
            answers[mode] = r.json()["choices"][0]["message"]["content"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert answers["auto"] == answers["xla"]
