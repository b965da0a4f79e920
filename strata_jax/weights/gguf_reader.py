"""Reading llama.cpp GGUF files (one file or a split `-00001-of-0000N.gguf` set): metadata and tensors.

Built on the `gguf` package's `GGUFReader`, which memory-maps the file: a tensor's bytes are read only when asked
for. Everything that can be wrong with a file (not GGUF, truncated, a tensor type this package cannot read, split
parts missing) becomes a `GGUFError` that names the file and, where there is one, the tensor.

Shapes are given in numpy order (the reverse of ggml's `ne`): a ggml `[n_embd, n_vocab]` tensor is `(n_vocab,
n_embd)` here, the Hugging Face orientation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata_jax.weights.safetensors_io import CheckpointError

try:  # the package is a dependency; a clear error if someone runs without it
    import gguf
    from gguf import GGMLQuantizationType as QType
    from gguf import GGUFReader, GGUFValueType
except ImportError as _e:  # pragma: no cover - exercised only without the dependency
    raise ImportError("reading GGUF files needs the `gguf` package (pip install gguf)") from _e

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
GGUF_MAGIC = b"GGUF"
# Tensor types whose values we can produce: plain floats, and every type `gguf.quants` dequantizes, plus Q1_0 (ours).
_PLAIN = {QType.F32: np.float32, QType.F16: np.float16, QType.F64: np.float64}


class GGUFError(CheckpointError):
    """A GGUF file is not readable, truncated, or holds something this package cannot run."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, ggml type, numpy-order shape and raw bytes (a memory map)."""

    name: str
    type: QType
    shape: tuple[int, ...]
    raw: np.ndarray  # float arrays for F32/F16/F64, uint8 [..., row bytes] for block types
    file: Path

    @property
    def type_name(self) -> str:
        return self.type.name


def supported_types() -> tuple[str, ...]:
    """ggml types this package can read (dequantize, or map onto packed planes)."""
    import gguf.quants as q

    names = [t.name for t in _PLAIN] + ["Q1_0"]
    names += [t.name for t in QType if t in getattr(q, "_type_traits", {}) and t.name not in names]
    return tuple(names)


def type_is_readable(t: QType) -> bool:
    return t.name in supported_types()


class _CheckedReader(GGUFReader):
    """`GGUFReader` that checks every tensor's type and extent before mapping it, so a bad tensor is named."""

    def __init__(self, path: Path):
        self._path = path
        super().__init__(str(path), "r")

    def _get_field_parts(self, orig_offs: int, raw_type: int):  # noqa: ANN201 - gguf's own signature
        """gguf's parser, with a fast path for arrays of strings (a tokenizer's 150-250K tokens and merges): the same
        parts, sliced from a plain ndarray view of the file instead of one np.memmap per string (~30x faster;
        opening a Flash-Next-sized vocabulary took ~45 s on a 2-core machine)."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" \
                or int(self._get(orig_offs, np.uint32)[0]) != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        plain = self.data.view(np.ndarray)
        parts, idxs, offs = [raw_itype, alen], [], orig_offs + 12
        for _ in range(int(alen[0])):
            slen = plain[offs : offs + 8].view(np.uint64)
            end = offs + 8 + int(slen[0])
            if end > len(plain):
                raise ValueError(f"string at byte {offs} runs past the end of the file")
            parts += [slen, plain[offs + 8 : end]]
            idxs.append(len(parts) - 1)
            offs = end
        types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if idxs else [])
        return offs - orig_offs, parts, idxs, types

    def _build_tensors(self, start_offs: int, fields) -> None:  # noqa: ANN001 - gguf's own signature
        size = len(self.data)
        for field in fields:
            _len, name_data, _n, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            type_id = int(raw_dtype[0])
            try:
                qtype = QType(type_id)
            except ValueError:
                raise GGUFError(f"{self._path}: tensor {name!r} has ggml type id {type_id}, which is unknown to the "
                                f"gguf package (supported: {', '.join(supported_types())})") from None
            if qtype not in gguf.GGML_QUANT_SIZES:
                raise GGUFError(f"{self._path}: tensor {name!r} has type {qtype.name} without a known block size")
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims.astype(np.int64))) if len(dims) else 1
            if len(dims) and int(dims[0]) % block:
                raise GGUFError(f"{self._path}: tensor {name!r} ({qtype.name}) has rows of {int(dims[0])} values, not "
                                f"a multiple of its block of {block}")
            end = start_offs + int(offset[0]) + n_elems * type_size // block
            if end > size:
                raise GGUFError(f"{self._path} is truncated: tensor {name!r} ends at byte {end}, the file has {size}")
        super()._build_tensors(start_offs, fields)


def _open(path: Path) -> _CheckedReader:
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (magic {head!r}, expected {GGUF_MAGIC!r})")
    try:
        return _CheckedReader(path)
    except GGUFError:
        raise
    except Exception as e:  # the gguf package raises ValueError/IndexError/KeyError on short or corrupt headers
        raise GGUFError(f"cannot read {path} (truncated or corrupt GGUF header?): {type(e).__name__}: {e}") from e


def split_parts(path: str | Path) -> list[Path]:
    """The files of a GGUF: itself, or every part of a `-0000i-of-0000N.gguf` set (any part may be named)."""
    path = Path(path)
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1:
        raise GGUFError(f"{path}: a split set of {count} parts")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"split GGUF {path.name}: part(s) {', '.join(missing)} missing in {path.parent}")
    return parts


def _field_value(field) -> Any:  # noqa: ANN001 - gguf.ReaderField
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
        return [x.item() for i in field.data for x in field.parts[i]]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape")
    value = field.parts[field.data[0]][0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value.item()


class GGUFFile:
    """Metadata and tensors of one GGUF model (all parts of a split set): name -> `TensorInfo`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.parts = split_parts(self.path)
        readers = [_open(p) for p in self.parts]
        self._meta: dict[str, Any] = {}
        for key, field in readers[0].fields.items():
            if not key.startswith("GGUF."):
                self._meta[key] = _field_value(field)
        if len(self.parts) > 1:
            count = self._meta.get("split.count")
            if count is not None and int(count) != len(self.parts):
                raise GGUFError(f"{self.parts[0]} says split.count = {count}, but the name says {len(self.parts)}")
        self._tensors: dict[str, TensorInfo] = {}
        for part, reader in zip(self.parts, readers):
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise GGUFError(f"tensor {t.name!r} appears twice ({self._tensors[t.name].file.name}, {part.name})")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self._tensors[t.name] = TensorInfo(t.name, t.tensor_type, shape, t.data, part)
        if "general.architecture" not in self._meta:
            raise GGUFError(f"{self.path} has no general.architecture")

    # -- metadata ---------------------------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    @property
    def architecture(self) -> str:
        return str(self._meta["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self._meta:
            raise GGUFError(f"{self.path} lacks the metadata key {key!r}")
        return self._meta[key]

    # -- tensors ----------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFError(f"tensor {name!r} not found in {self.path}") from None

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order (every supported type)."""
        t = self.info(name)
        return dequantize_tensor(t)

    def total_bytes(self) -> int:
        return sum(int(t.raw.nbytes) for t in self._tensors.values())


def dequantize_tensor(t: TensorInfo) -> np.ndarray:
    """float32 values of a tensor, numpy-order shape. Raises GGUFError (naming tensor and type) if unsupported."""
    if t.type in _PLAIN:
        return np.asarray(t.raw, dtype=np.float32).reshape(t.shape)
    if t.type == QType.Q1_0:
        return dequantize_q1_0(np.asarray(t.raw)).reshape(t.shape)
    if not type_is_readable(t.type):
        raise GGUFError(f"tensor {t.name!r} has type {t.type_name}, which strata_jax cannot read "
                        f"(supported: {', '.join(supported_types())})")
    import gguf.quants as q

    try:
        return np.asarray(q.dequantize(np.asarray(t.raw), t.type), dtype=np.float32).reshape(t.shape)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {t.name!r} has type {t.type_name}, which cannot be dequantized: {e}") from e


# -- Q1_0: 1 sign bit per weight + one fp16 scale per 128 (ggml-common.h block_q1_0) ------------------------------
Q1_0_BLOCK = 128
Q1_0_BYTES = 18  # fp16 d, then 16 bytes of bits: bit j of the block = (qs[j // 8] >> (j % 8)) & 1, 1 -> +d


def q1_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q1_0 rows uint8 [..., K/128 * 18] -> (d float16 [..., K/128], qs uint8 [..., K/128, 16])."""
    raw = np.asarray(raw, np.uint8)
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // Q1_0_BYTES, Q1_0_BYTES)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    return d, blocks[..., 2:]


def dequantize_q1_0(raw: np.ndarray) -> np.ndarray:
    """Raw Q1_0 rows -> float32 [..., K] (ggml's dequantize_row_q1_0)."""
    d, qs = q1_0_blocks(raw)
    bits = np.unpackbits(qs, axis=-1, bitorder="little").astype(np.float32)  # [..., nb, 128]
    w = (2.0 * bits - 1.0) * d.astype(np.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1)
