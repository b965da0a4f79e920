"""Reading Hugging Face safetensors checkpoints (one file or sharded with an index), tensor by tensor.

Files are opened with `safetensors.safe_open` (memory-mapped): a tensor is read only when asked for, so a large
checkpoint is never copied whole into RAM. Tables that must stay on the host (PLE) are exposed as read-only
`np.memmap` views so that gathering a few rows touches only those pages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or does not match the model it should describe."""


class CheckpointReader:
    """Name -> tensor access over every safetensors file of a checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in the index but missing")
            try:
                handle = safe_open(str(file), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
                raise CheckpointError(f"cannot read {file} (truncated or not safetensors?): {e}") from e
            self._handles[name] = handle
            for key in handle.keys():
                self._file_of[key] = name
        if weight_map is not None:
            missing = [k for k in weight_map if k not in self._file_of]
            if missing:
                raise CheckpointError(f"tensor {missing[0]!r} is in the index but not in {weight_map[missing[0]]}")

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file(name)].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """Reads one tensor into memory (bf16 as `ml_dtypes.bfloat16`)."""
        try:
            return self._handles[self._file(name)].get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self._file(name)}: {e}") from e

    def memmap(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor (nothing is read until indexed)."""
        file = self.path / self._file(name)
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        info = header[name]
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if (end - begin) != int(np.prod(shape)) * dtype.itemsize or file.stat().st_size < 8 + header_len + end:
            raise CheckpointError(f"tensor {name!r} in {file} is truncated")
        return np.memmap(file, dtype=dtype, mode="r", offset=8 + header_len + begin, shape=shape)

    def _file(self, name: str) -> str:
        try:
            return self._file_of[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in the checkpoint at {self.path}") from None
