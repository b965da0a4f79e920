"""The demo checkpoint and the web page ship inside the package: a wheel built from the tree holds them, and the
installed package finds and loads the demo from outside any checkout."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_wheel_carries_the_demo_and_serves_it_outside_a_checkout(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT),
                          "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    wheel = next((tmp_path / "wheel").glob("strata_jax-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {f"strata_jax/demo/{f}" for f in DEMO_FILES} <= names
        # The web page served at `/` (package data of `server`).
        web = {p.name for p in (ROOT / "server" / "web").iterdir() if p.suffix in (".html", ".js", ".css")}
        assert {"index.html", "app.js", "markdown.js", "style.css"} <= web
        assert {f"server/web/{f}" for f in web} <= names
        assert not any(n.startswith(("tools/", "tests/")) for n in names)
        z.extractall(tmp_path / "site")
    code = ("import strata_jax\n"
            "from strata_jax.demo import DEMO_MODEL\n"
            "assert str(DEMO_MODEL).startswith(sys.argv[1]), DEMO_MODEL\n"
            "model = strata_jax.load_model(DEMO_MODEL)\n"
            "print(len(model.generate(model.tokenizer.encode('def add(a, b):'), 4, stop_at_eos=False)))\n")
    env_path = str(tmp_path / "site")
    run = subprocess.run([sys.executable, "-c", "import sys\n" + code, env_path], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin",
                                                      "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "4"
