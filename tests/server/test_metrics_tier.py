"""/metrics exports the GPU expert pool's hit rate from the engine's JAX-free stats()."""

from server.metrics import ServerMetrics


def _scrape(stats) -> str:
    return ServerMetrics(lambda: stats).render()[0].decode()


def test_hit_rate_gauge():
    text = _scrape({"expert_gpu_hit_rate": 0.75, "expert_pairs_total": 40, "expert_gpu_pairs_total": 30})
    assert "strata_expert_gpu_hit_rate 0.75" in text
    assert "strata_engine_expert_pairs_total 40.0" in text and "strata_engine_expert_gpu_pairs_total 30.0" in text
    assert "strata_expert_gpu_hit_rate 1.0" in _scrape({"slots_busy": 0})  # every expert on the GPU


def test_server_metrics_do_not_import_jax():
    import subprocess
    import sys

    code = "import sys, server.metrics; assert 'jax' not in sys.modules, 'jax imported'"
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
