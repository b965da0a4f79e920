"""The bundled demo checkpoint (a 9 MB qwen4_exp; see README.md here), shipped as package data: the default model
of `serve`, `generate` and the users benchmark. `tools/train_demo.py` made it."""

from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent
