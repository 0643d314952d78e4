"""Memory-mapped reading of `*.safetensors` files, bfloat16 and float8_e4m3fn included.

The `safetensors` package's numpy loader rejects bfloat16, the usual dtype of released weights, so
this reads the format directly: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes. Tensors are memory-mapped, so a loader
reads only what it slices (and a sharded loader only its shard).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

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
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # pre-quantized checkpoints' fp8 weights
}


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where tensor data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file.")
        (length,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, read-only memory-mapped array) for every tensor in one file."""
    header, data_start = read_header(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"Tensor {name!r} in {path} has unsupported dtype {info['dtype']}.")
        begin, end = info["data_offsets"]
        raw = mapped[data_start + begin : data_start + end]
        yield name, raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def weight_files(model_dir: Path) -> list[Path]:
    """A model folder's safetensors files: the sharded index's files, or every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {missing}.")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weights in {model_dir}.")
    return files
