"""Reading (lazily, memory-mapped) and writing `.safetensors` files, single or sharded with an index.

Written against the format itself (8-byte header length, JSON header, raw little-endian data) rather than the
`safetensors` numpy binding because that binding cannot return bfloat16, the dtype of most published MoE
checkpoints. Tensors come back as read-only views of the mapped file: nothing is copied until a caller converts.
A truncated file is detected when it is opened, by comparing the header's extents with the file size.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from moe_jax.errors import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (header runs past the end)")
                header = json.loads(f.read(header_len))
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self._base = 8 + header_len
        self._entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self._base + end > size:
            raise CheckpointError(
                f"{self.path}: truncated safetensors file ({size} bytes, header says {self._base + end})"
            )
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)

    def keys(self):
        return self._entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        start, stop = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if (stop - start) != int(np.prod(shape)) * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} byte range does not match its shape {shape}")
        return self._mmap[self._base + start : self._base + stop].view(dtype).reshape(shape)


class TensorSource:
    """All tensors of a checkpoint directory by name, wherever they are sharded."""

    def __init__(self, directory: Path, files: list[Path]):
        self.directory = Path(directory)
        self._files = [SafetensorsFile(p) for p in files]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self._files:
            for k in f.keys():
                self._where[k] = f

    @classmethod
    def open(cls, directory: Path) -> TensorSource:
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable shard index ({e})") from e
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (directory / n).exists()]
            if missing:
                raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
            files = [directory / n for n in names]
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors weight files found")
        return cls(directory, files)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self):
        return self._where.keys()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        array = f.get(name)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{f.path}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        return array


_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def save_safetensors(path: Path, tensors: dict[str, np.ndarray]):
    """Writes `tensors` to `path` atomically (temporary file, then rename), any dtype the reader knows."""
    header, offset = {}, 0
    for name, array in tensors.items():
        code = _CODES.get(np.dtype(array.dtype))
        if code is None:
            raise CheckpointError(f"{path}: cannot store tensor {name!r} of dtype {array.dtype}")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
