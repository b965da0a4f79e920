"""`serve --compile-cache`: where jax's persistent compilation cache goes, and that a jitted program lands in it
(the end-to-end serve test checks that the engine's warm-up fills it)."""

from __future__ import annotations

import subprocess
import sys

from strata_jax.compile_cache import default_cache_dir, enable_compile_cache


def test_the_default_directory_follows_jax_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert default_cache_dir() == str(tmp_path / "jax")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "strata_jax" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "strata_jax" / "xla")


def test_off_and_an_unusable_directory_leave_jax_alone(tmp_path, capsys):
    assert enable_compile_cache("off") is None and enable_compile_cache(None) is None
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert enable_compile_cache(str(blocker / "xla")) is None
    assert "compile cache off: cannot create" in capsys.readouterr().out


def test_a_compiled_program_is_stored_and_found_again(tmp_path):
    """Two processes compile the same program: the first stores it, the second finds it (jax counts the hit)."""
    script = f"""
import jax, jax.numpy as jnp
from strata_jax.compile_cache import enable_compile_cache
assert enable_compile_cache({str(tmp_path)!r}) == {str(tmp_path)!r}
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jax._src import monitoring
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if "cache_hits" in name else None)
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
print(float(f(jnp.ones((64, 64)))), len(hits))
"""
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    (value1, hits1), (value2, hits2) = (r.stdout.split() for r in runs)
    assert value1 == value2 and any(tmp_path.iterdir())
    assert int(hits1) == 0 and int(hits2) >= 1
