"""The kernel notebook runs top to bottom on CPU (Pallas in interpret mode, small shapes)."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_onebit_kernel_notebook_runs_on_cpu(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = nbformat.read(ROOT / "notebooks" / "onebit_kernel.ipynb", as_version=4)
    with pytest.MonkeyPatch.context() as mp:  # the kernel process inherits this environment
        old = os.environ.get("PYTHONPATH")
        mp.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + old if old else ""))
        mp.setenv("JAX_PLATFORMS", "cpu")
        client = nbclient.NotebookClient(
            nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        )
        client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "pallas grouped" in text and "floor" in text
    # The floors use a bandwidth measured on this device (no placeholder figure) ...
    measured = re.search(r"copy bandwidth ([\d.]+) GB/s \(read\+write\), read ([\d.]+) GB/s, measured on", text)
    assert measured and float(measured[1]) > 0 and float(measured[2]) > 0, text
    # ... and the roofline plot is shown inline, in the notebook itself.
    assert any(o.output_type == "display_data" and "image/png" in o.get("data", {}) for o in outputs)
