"""`serve` with the host expert tier: a converted demo checkpoint served with a quarter of its experts in the device
pool states the CPU budget and the pool at start-up, answers like the all-resident server, and exports the pool's
hit rate on /metrics."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import httpx
from test_server_cli import _lines, _wait_for

from strata_jax.demo import DEMO_MODEL as DEMO

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_1bit") / "ckpt"
    subprocess.run([sys.executable, "-m", "strata_jax", "quantize", "--model", str(DEMO), "--out", str(out),
                    "--dtype", "float32"], check=True, capture_output=True, timeout=600, cwd=ROOT)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (out / name).exists() and (DEMO / name).exists():
            (out / name).write_bytes((DEMO / name).read_bytes())
    return out


def _serve_and_ask(model: Path, *extra: str) -> tuple[str, str, str]:
    """(start-up output, completion text, /metrics body)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("STRATA_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_jax", "serve", "--model", str(model), "--port", "0", "--slots", "2",
         "--ctx", "128", "--served-name", "demo", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )
    seen: list[str] = []
    try:
        q = _lines(proc)
        url = _wait_for(q, r"^listening on (http://\S+)$", 300, seen).group(1)
        body = {"model": "demo", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "def add(a, b):"}]}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        metrics = httpx.get(url + "/metrics").text
        return "".join(seen), reply["choices"][0]["message"]["content"], metrics
    finally:
        proc.terminate()
        proc.wait(60)


def test_serve_with_host_tier(converted):
    log, text, metrics = _serve_and_ask(converted, "--gpu-experts", "4", "--pool-workers", "1")
    assert "pool workers (--pool-workers)" in log
    assert "host expert tier: --gpu-experts 4 experts per MoE layer" in log
    assert "arrive with a later issue" not in log
    rate = [line for line in metrics.splitlines() if line.startswith("strata_engine_expert_gpu_hit_rate ")]
    assert rate and 0.0 < float(rate[0].split()[1]) < 1.0
    pairs = [line for line in metrics.splitlines() if line.startswith("strata_engine_expert_pairs_total ")]
    assert float(pairs[0].split()[1]) > 0
    log_all, text_all, metrics_all = _serve_and_ask(converted)
    assert "every weight stays resident" in log_all
    assert text == text_all  # greedy: the host tier does not change the answer
    assert "strata_engine_expert_gpu_hit_rate" not in metrics_all
