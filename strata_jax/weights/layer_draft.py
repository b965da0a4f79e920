"""A draft model cut from a checkpoint's own layers (`python -m strata_jax.weights.layer_draft`).

Keeps the embedding, the chosen decoder layers, the final norm / hyper-connection mixer and the LM head, and drops
every other layer, the PLE layers and the MTP head: a smaller model with the same tokenizer that predicts the next
token from a shallower stack ("early exit" / layer-skip self-speculation). `serve --draft DIR` and
`bench --draft DIR` take the result. Only layers without PLE can be kept (the draft-model drafter does not feed PLE
rows); the weights are written as float32 safetensors (the draft is small) beside a copy of the tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from strata_jax.model.config import load_config
from strata_jax.weights.safetensors_io import CheckpointReader

_LAYER = re.compile(r"^(model\.(?:language_model\.)?layers)\.(\d+)\.(.*)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def make_layer_draft(src: str | Path, out: str | Path, layers: list[int]) -> Path:
    """Writes to `out` the checkpoint at `src` reduced to decoder `layers` (0-based, in order). Returns `out`."""
    src, out = Path(src), Path(out)
    cfg = load_config(src)
    bad = [i for i in layers if not 0 <= i < cfg.num_layers]
    if not layers or bad:
        raise ValueError(f"layers must be a non-empty subset of 0..{cfg.num_layers - 1}, got {layers}")
    with_ple = sorted(set(layers) & set(cfg.ple_layers))
    if with_ple:
        raise ValueError(f"layers {with_ple} have PLE, which draft models cannot use; pick others")
    raw = json.loads((src / "config.json").read_text())
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = len(layers)
    if "layer_types" in text:
        text["layer_types"] = [text["layer_types"][i] for i in layers]
    for key in ("ple_layer_ids", "mtp_layer_types"):
        text.pop(key, None)
    text["num_mtp_layers"] = 0
    renumber = {old: new for new, old in enumerate(layers)}
    tensors: dict[str, np.ndarray] = {}
    reader = CheckpointReader(src)
    for name in reader.names():
        m = _LAYER.match(name)
        if name.startswith("mtp."):
            continue
        if m:
            if int(m.group(2)) not in renumber:
                continue
            name_out = f"{m.group(1)}.{renumber[int(m.group(2))]}.{m.group(3)}"
        else:
            name_out = name
        tensors[name_out] = np.ascontiguousarray(reader.get(name).astype(np.float32))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata_jax.weights.layer_draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="source checkpoint directory (HF layout)")
    p.add_argument("--out", required=True, help="directory for the draft checkpoint")
    p.add_argument("--layers", default="0", help="comma-separated 0-based decoder layers to keep (default 0)")
    args = p.parse_args(argv)
    try:
        out = make_layer_draft(args.model, args.out, [int(i) for i in args.layers.split(",")])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
