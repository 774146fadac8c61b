"""Reading (lazily, memory-mapped) and writing `.safetensors` files, single or sharded with an index.

Written against the format itself (8-byte header length, JSON header, raw little-endian data) rather than the
`safetensors` numpy binding because that binding cannot return bfloat16, the dtype of most published MoE
checkpoints. Tensors come back as read-only views of the mapped file: nothing is copied until a caller converts.
A truncated file is detected when it is opened, by comparing the header's extents with the file size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from host_kernels import release_pages
from moe_jax.errors import CheckpointError, is_int

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
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # block-scaled fp8 checkpoints (moe_jax/formats/fp8.py)
}
# Every dtype code of the format with its element size, so a file holding tensors this reader cannot return (e5m2,
# unsigned wide ints) still has each entry's extent checked; asking for such a tensor is a CheckpointError.
_ITEMSIZES = {code: dtype.itemsize for code, dtype in _DTYPES.items()} | {
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E5M2": 1,
}
# The safetensors library's own cap: a larger header is refused before it is read.
MAX_HEADER_BYTES = 100_000_000


def _entry_extent(path: Path, name: str, entry) -> tuple[int, int]:
    """The (start, stop) byte range of one header entry, after checking every field it has."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is {type(entry).__name__}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ITEMSIZES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(_ITEMSIZES)})")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not two non-negative integers")
    start, stop = offsets
    expected = math.prod(shape) * _ITEMSIZES[dtype]
    if stop - start != expected:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} hold {stop - start} bytes, but {dtype} x {tuple(shape)} is {expected}"
        )
    return start, stop


def _parse_header(path: Path, raw: bytes, data_bytes: int) -> dict[str, dict]:
    """The header's tensor entries, checked: each extent inside the data region and no two overlapping."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is {type(metadata).__name__}, not an object")
    extents = sorted((*_entry_extent(path, name, entry), name) for name, entry in header.items())
    previous_stop, previous_name = 0, None
    for start, stop, name in extents:
        if stop > data_bytes:
            raise CheckpointError(
                f"{path}: truncated safetensors file (tensor {name!r} ends at data byte {stop}, "
                f"the file holds {data_bytes})"
            )
        if start < previous_stop:
            raise CheckpointError(f"{path}: tensors {previous_name!r} and {name!r} overlap in the data region")
        previous_stop, previous_name = stop, name
    return header


class SafetensorsFile:
    """One `.safetensors` file, its header validated when opened (so a malformed file is a CheckpointError naming
    the tensor, never a silently wrong array); tensors are returned as read-only views of the mapped file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > MAX_HEADER_BYTES:
                    raise CheckpointError(
                        f"{self.path}: safetensors header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} limit"
                    )
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (header runs past the end)")
                raw = f.read(header_len)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from e
        self._base = 8 + header_len
        self._entries = _parse_header(self.path, raw, size - self._base)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)

    def keys(self):
        return self._entries.keys()

    def release_pages(self):
        """Drops the mapped pages read so far from this process's memory (the arrays stay valid: a page read again
        comes back from the file). The weights loaded from a file are copies; without this, the pages they were
        copied from would stay counted in the process's RSS for as long as the checkpoint is open."""
        release_pages(self._mmap)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype_code(self, name: str) -> str:
        """A tensor's dtype as the header spells it ("BF16", "F8_E4M3", ...)."""
        return self._entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which moe_jax cannot load")
        start, stop = entry["data_offsets"]
        return self._mmap[self._base + start : self._base + stop].view(dtype).reshape(entry["shape"])


class TensorSource:
    """All tensors of a checkpoint directory by name, wherever they are sharded."""

    def __init__(self, directory: Path, files: list[Path]):
        self.directory = Path(directory)
        self._files = [SafetensorsFile(p) for p in files]
        self._where: dict[str, SafetensorsFile] = {}
        self._stored: dict[str, str] = {}  # a renamed tensor's name in its file (`rename_prefix`)
        for f in self._files:
            for k in f.keys():
                if k in self._where:
                    raise CheckpointError(
                        f"{self.directory}: tensor {k!r} is in both {self._where[k].path} and {f.path}"
                    )
                self._where[k] = f

    @classmethod
    def open(cls, directory: Path) -> TensorSource:
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = [directory / n for n in _shard_names(index)]
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors weight files found")
        return cls(directory, files)

    def rename_prefix(self, stored: str, name: str):
        """Tensors stored as `stored` + rest are read as `name` + rest (a multimodal release's language model,
        `model.language_model.layers...`, as the `model.layers...` moe_jax reads)."""
        for key in [k for k in self._where if k.startswith(stored)]:
            renamed = name + key[len(stored) :]
            if renamed in self._where:
                raise CheckpointError(f"{self.directory}: holds both {key!r} and {renamed!r}")
            self._where[renamed] = self._where.pop(key)
            self._stored[renamed] = key

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def release_pages(self):
        """`SafetensorsFile.release_pages` for every file."""
        for f in self._files:
            f.release_pages()

    def names(self):
        return self._where.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the header, without touching its data."""
        return self._where[name].shape(self._stored.get(name, name))

    def dtype_code(self, name: str) -> str:
        return self._where[name].dtype_code(self._stored.get(name, name))

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        array = f.get(self._stored.get(name, name))
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{f.path}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        return array


def _shard_names(index: Path) -> list[str]:
    """The shard files an index lists: plain file names in the index's own directory, each present."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: unreadable shard index ({e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map is not an object of tensor name -> shard file name")
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
    if outside:
        raise CheckpointError(f"{index}: shard names must be file names in {index.parent}, got {outside[0]!r}")
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
    return names


_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def save_safetensors(path: Path, tensors: dict[str, np.ndarray]):
    """Writes `tensors` to `path` atomically (temporary file, then rename), any dtype the reader knows."""
    layout = {name: (tuple(array.shape), array.dtype) for name, array in tensors.items()}
    write_safetensors(path, layout, lambda name: tensors[name])


def write_safetensors(path: Path, layout: dict[str, tuple[tuple[int, ...], np.dtype]], read):
    """Writes the tensors `layout` names ({name: (shape, dtype)}, in file order) to `path` atomically, asking
    `read(name)` for each only when its turn comes: one tensor in memory at a time, whatever the checkpoint's
    size. A tensor whose shape or dtype is not the one declared is refused by name (nothing is left behind)."""
    header, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        code = _CODES.get(np.dtype(dtype))
        if code is None:
            raise CheckpointError(f"{path}: cannot store tensor {name!r} of dtype {dtype}")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, (shape, dtype) in layout.items():
                array = read(name)
                if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
                    raise CheckpointError(
                        f"{path}: tensor {name!r} is {array.dtype} {tuple(array.shape)}, declared {np.dtype(dtype)} "
                        f"{tuple(shape)}"
                    )
                f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
                del array
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
