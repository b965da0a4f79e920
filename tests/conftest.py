"""Shared test setup: the `gpu` marker skips unless JAX has a GPU backend."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def _has_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def pytest_configure(config):
    if _has_gpu():
        import jax

        # Parity is checked in true float32: TF32 matmuls would flip near-tied router choices.
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
