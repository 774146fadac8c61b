"""The expert weight store: per-layer expert weights pre-converted to the kernel's layout, memory-mapped.

Layout (version 1), per MoE layer:
  w13 [experts, hidden, 2 * ffn]  gate columns [0, ffn) then up columns [ffn, 2 * ffn): `x @ w13[e]` gives both
                                  projections in one GEMM over contiguous memory.
  w2  [experts, ffn, hidden]      `act @ w2[e]`.
On disk: `manifest.json` plus one raw little-endian file per tensor. Opening maps the files read-only, so loading a
model costs neither a copy nor a conversion. Sizes are checked at open (a truncated store fails there, not at first
use); SHA-256 checksums are checked when asked (`verify=True`), since hashing a large model takes minutes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from host_kernels.errors import StoreError

LAYOUT_VERSION = 1
FORMAT_NAME = "moe_jax.expert_store"
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclass(frozen=True)
class LayerExperts:
    """One layer's expert weights in kernel layout (arrays may be memory-mapped, read-only)."""

    w13: np.ndarray  # [e, d, 2f]
    w2: np.ndarray  # [e, f, d]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[1]

    @property
    def ffn(self) -> int:
        return self.w2.shape[1]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights as stored."""
        return (self.w13[0].size + self.w2[0].size) * self.w13.dtype.itemsize

    def validate(self, name: str):
        e, d, f2 = self.w13.shape
        if self.w2.shape != (e, f2 // 2, d) or f2 % 2:
            raise StoreError(f"{name}: w13 shape {self.w13.shape} and w2 shape {self.w2.shape} do not fit together")
        if self.w13.dtype != self.w2.dtype or self.w13.dtype not in STORAGE_DTYPES.values():
            raise StoreError(f"{name}: unsupported storage dtypes {self.w13.dtype}/{self.w2.dtype}")


class ExpertStore:
    """All MoE layers' expert weights, keyed by layer index."""

    def __init__(self, layers: dict[int, LayerExperts], path: Path | None = None):
        for i, layer in layers.items():
            layer.validate(f"layer {i}")
        self.layers = dict(layers)
        self.path = path

    def __getitem__(self, layer: int) -> LayerExperts:
        try:
            return self.layers[layer]
        except KeyError:
            raise StoreError(f"expert store has no layer {layer} (has {sorted(self.layers)})") from None

    @property
    def dtype(self) -> np.dtype:
        return next(iter(self.layers.values())).w13.dtype

    @property
    def nbytes(self) -> int:
        return sum(layer.w13.nbytes + layer.w2.nbytes for layer in self.layers.values())

    @classmethod
    def open(cls, path, verify: bool = False) -> ExpertStore:
        path = Path(path)
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise StoreError(f"{manifest_path}: not found (is {path} an expert store?)") from None
        except (OSError, ValueError) as e:
            raise StoreError(f"{manifest_path}: unreadable ({e})") from e
        if manifest.get("format") != FORMAT_NAME:
            raise StoreError(f"{manifest_path}: not an expert store manifest (format={manifest.get('format')!r})")
        if manifest.get("layout_version") != LAYOUT_VERSION:
            raise StoreError(
                f"{manifest_path}: layout version {manifest.get('layout_version')} but this build reads "
                f"version {LAYOUT_VERSION}; reconvert with `python -m moe_jax.convert`"
            )
        dtype = STORAGE_DTYPES.get(manifest.get("dtype"))
        if dtype is None:
            raise StoreError(f"{manifest_path}: unsupported dtype {manifest.get('dtype')!r}")
        layers = {}
        for key, tensors in manifest["layers"].items():
            arrays = {}
            for name in ("w13", "w2"):
                entry = tensors[name]
                file = path / entry["file"]
                shape = tuple(entry["shape"])
                expected = int(np.prod(shape)) * dtype.itemsize
                actual = file.stat().st_size if file.exists() else None
                if actual != expected:
                    raise StoreError(
                        f"{file}: layer {key} {name} is {'missing' if actual is None else f'{actual} bytes'}, "
                        f"expected {expected} bytes (truncated or incomplete store)"
                    )
                if verify and file_sha256(file) != entry["sha256"]:
                    raise StoreError(f"{file}: layer {key} {name} checksum mismatch (file is corrupt)")
                arrays[name] = np.memmap(file, dtype=dtype, mode="r", shape=shape)
            layers[int(key)] = LayerExperts(arrays["w13"], arrays["w2"])
        return cls(layers, path)


class StoreWriter:
    """Writes a store one layer at a time into a temporary directory, renamed into place on `close()`.

    A crash mid-conversion leaves only the temporary directory, never a store that opens.
    """

    def __init__(self, path, dtype: str = "float32"):
        if dtype not in STORAGE_DTYPES:
            raise StoreError(f"unsupported storage dtype {dtype!r}; use one of {sorted(STORAGE_DTYPES)}")
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.dtype = dtype
        self.manifest = {
            "format": FORMAT_NAME,
            "layout_version": LAYOUT_VERSION,
            "dtype": dtype,
            "layers": {},
        }

    def add_layer(self, layer: int, w13: np.ndarray, w2: np.ndarray):
        LayerExperts(w13.astype(STORAGE_DTYPES[self.dtype]), w2.astype(STORAGE_DTYPES[self.dtype])).validate(
            f"layer {layer}"
        )
        entry = {}
        for name, array in (("w13", w13), ("w2", w2)):
            file = f"layer{layer:04d}.{name}.bin"
            data = np.ascontiguousarray(array, dtype=STORAGE_DTYPES[self.dtype])
            raw = data.reshape(-1).view(np.uint8)  # bfloat16 has no buffer-protocol format code
            with open(self.tmp / file, "wb") as f:
                f.write(raw.data)
                f.flush()
                os.fsync(f.fileno())
            entry[name] = {
                "file": file,
                "shape": list(data.shape),
                "sha256": hashlib.sha256(raw.data).hexdigest(),
            }
        self.manifest["layers"][str(layer)] = entry

    def close(self):
        (self.tmp / MANIFEST).write_text(json.dumps(self.manifest, indent=1))
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self.tmp, self.path)


def file_sha256(file) -> str:
    """SHA-256 hex digest of a file's content, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
