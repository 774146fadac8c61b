"""The expert weight store: per-layer expert weights pre-converted to the kernel's layout, memory-mapped.

How it works and why: docs/INTERNALS.md, host_kernels/store.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
from pathlib import Path

import numpy as np

from host_kernels.errors import StoreError
from host_kernels.layer_experts import STORAGE_DTYPES, LayerExperts, QuantizedLayerExperts, quantize_layer
from host_kernels.quant_formats import FORMATS

LAYOUT_VERSION = 1
QUANTIZED_LAYOUT_VERSION = 2
FORMAT_NAME = "moe_jax.expert_store"
MANIFEST = "manifest.json"


class ExpertStore:
    """All MoE layers' expert weights, keyed by layer index.

    A store opened from disk remembers each file's size and modification time: every `store[layer]` checks them
    again, so a file truncated or rewritten in place under a running job is a StoreError at the layer's next use
    instead of a SIGBUS (a mapped page past the file's new end) or weights silently mixed from two conversions."""

    def __init__(self, layers: dict, path: Path | None = None, files=None, dtype=None):
        """`layers`: LayerExperts, or QuantizedLayerExperts of one format; then `dtype` (float32 or bfloat16) is
        the dtype their products take rows in (the store's source dtype)."""
        for i, layer in layers.items():
            layer.validate(f"layer {i}")
        quants = {layer.quant for layer in layers.values()}
        if len(quants) > 1:
            raise StoreError(f"expert store mixes formats {sorted(map(str, quants))}")
        self.layers = dict(layers)
        self.path = path
        self.quant: str | None = quants.pop() if quants else None
        if self.quant is not None and np.dtype(dtype) not in STORAGE_DTYPES.values():
            raise StoreError(f"a {self.quant} store needs the dtype its products run in, got {dtype!r}")
        self._dtype = np.dtype(dtype) if self.quant else None
        self._files: dict[int, list[tuple[Path, os.stat_result]]] = files or {}

    def __getitem__(self, layer: int):
        try:
            experts = self.layers[layer]
        except KeyError:
            raise StoreError(f"expert store has no layer {layer} (has {sorted(self.layers)})") from None
        for file, opened in self._files.get(layer, ()):
            _check_unchanged(file, opened)
        return experts

    def shard(self, experts: range) -> ExpertStore:
        """The same store holding only `experts` of every layer (views: a mapped store reads only their pages)."""
        layers = {i: layer.select(experts) for i, layer in self.layers.items()}
        return ExpertStore(layers, self.path, self._files, self._dtype)

    def release_pages(self, layer: int):
        """Drops a float layer's mapped pages from memory (`release_pages`), once a packed copy has replaced them
        (they are read again from the file if needed). A quantized layer's pages are what its kernel reads: kept."""
        experts = self.layers[layer]
        if experts.quant is None:
            release_pages(experts.w13)
            release_pages(experts.w2)

    @property
    def dtype(self) -> np.dtype:
        """The stored weights' dtype; for a quantized store, the dtype its products take rows in."""
        return self._dtype if self.quant else next(iter(self.layers.values())).w13.dtype

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

    @classmethod
    def open(cls, path, verify: bool = False) -> ExpertStore:
        """Maps a store directory. Every manifest field is type-checked and every file's size compared with its
        shape; `verify=True` also compares each file's SHA-256 with the one the converter recorded."""
        path = Path(path)
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise StoreError(f"{manifest_path}: not found (is {path} an expert store?)") from None
        except (OSError, ValueError, RecursionError) as e:
            raise StoreError(f"{manifest_path}: unreadable ({e})") from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            format_name = manifest.get("format") if isinstance(manifest, dict) else None
            raise StoreError(f"{manifest_path}: not an expert store manifest (format={format_name!r})")
        quant = manifest.get("quant")
        version = QUANTIZED_LAYOUT_VERSION if quant is not None else LAYOUT_VERSION
        if manifest.get("layout_version") != version:
            raise StoreError(
                f"{manifest_path}: layout version {manifest.get('layout_version')} but this build reads "
                f"version {version}{' for quantized stores' if quant is not None else ''}; reconvert with "
                "`python -m moe_jax.convert`"
            )
        if quant is not None and (not isinstance(quant, str) or quant not in FORMATS):
            raise StoreError(f"{manifest_path}: unknown quantized format {quant!r} (this build reads {list(FORMATS)})")
        sizes = [manifest.get(key) for key in ("hidden", "ffn")]
        if quant is not None and not all(type(v) is int and v > 0 for v in sizes):
            raise StoreError(f"{manifest_path}: a quantized store needs positive integer 'hidden' and 'ffn'")
        dtype = STORAGE_DTYPES.get(manifest.get("dtype")) if isinstance(manifest.get("dtype"), str) else None
        if dtype is None:
            raise StoreError(f"{manifest_path}: unsupported dtype {manifest.get('dtype')!r}")
        if not isinstance(manifest.get("layers"), dict) or not manifest["layers"]:
            raise StoreError(f"{manifest_path}: 'layers' must be a non-empty object of layer index -> tensors")
        file_dtype = np.dtype(np.uint8) if quant is not None else dtype
        layers, files = {}, {}
        for key, tensors in manifest["layers"].items():
            if not key.isdigit() or not isinstance(tensors, dict):
                raise StoreError(f"{manifest_path}: layer {key!r} must be a layer index holding w13 and w2")
            arrays, files[int(key)] = {}, []
            for name in ("w13", "w2"):
                file, shape, sha256 = _manifest_entry(manifest_path, key, name, tensors.get(name))
                expected = math.prod(shape) * file_dtype.itemsize
                try:
                    opened = file.stat()
                except FileNotFoundError:
                    opened = None
                if opened is None or opened.st_size != expected:
                    raise StoreError(
                        f"{file}: layer {key} {name} is "
                        f"{'missing' if opened is None else f'{opened.st_size} bytes'}, "
                        f"expected {expected} bytes (truncated or incomplete store)"
                    )
                if verify and file_sha256(file) != sha256:
                    raise StoreError(f"{file}: layer {key} {name} checksum mismatch (file is corrupt)")
                arrays[name] = np.memmap(file, dtype=file_dtype, mode="r", shape=shape)
                _advise(arrays[name], "MADV_HUGEPAGE")  # page cache in 2 MB folios where the filesystem has them
                files[int(key)].append((file, opened))
            if quant is None:
                layers[int(key)] = LayerExperts(arrays["w13"], arrays["w2"])
            else:
                layers[int(key)] = QuantizedLayerExperts(quant, arrays["w13"], arrays["w2"], *sizes)
        try:
            return cls(layers, path, files, dtype)
        except StoreError as e:
            raise StoreError(f"{manifest_path}: {e}") from None


def _manifest_entry(manifest_path: Path, layer: str, name: str, entry) -> tuple[Path, tuple[int, ...], str]:
    """(file, shape, sha256) of one tensor's manifest entry, each field checked; the file must be in the store."""
    where = f"{manifest_path}: layer {layer} {name}"
    if not isinstance(entry, dict):
        raise StoreError(f"{where}: entry is {type(entry).__name__}, not an object with file, shape and sha256")
    file, shape, sha256 = entry.get("file"), entry.get("shape"), entry.get("sha256")
    if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
        raise StoreError(f"{where}: file {file!r} must be a file name inside {manifest_path.parent}")
    if not (
        isinstance(shape, list)
        and len(shape) == 3
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise StoreError(f"{where}: shape {shape!r} must be three positive integers")
    if not (isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)):
        raise StoreError(f"{where}: sha256 {sha256!r} is not a SHA-256 hex digest")
    return manifest_path.parent / file, tuple(shape), sha256


def _check_unchanged(file: Path, opened: os.stat_result):
    """A file written in place since it was mapped (same inode, other size or time) is refused. One removed or
    replaced by a rename (as convert --overwrite does) is fine: the mapping keeps the old file, whole."""
    try:
        now = file.stat()
    except OSError:
        return
    if now.st_ino == opened.st_ino and (now.st_size, now.st_mtime_ns) != (opened.st_size, opened.st_mtime_ns):
        raise StoreError(
            f"{file}: written to since the store was opened ({opened.st_size} -> {now.st_size} bytes); "
            "a store must not be modified while a job uses it: restart the job"
        )


class StoreWriter:
    """Writes a store one layer at a time into a temporary directory, renamed into place on `close()`.

    A crash mid-conversion leaves only the temporary directory, never a store that opens.
    """

    def __init__(self, path, dtype: str = "float32", quant: str | None = None):
        """`quant` (a quant_formats.FORMATS name): each layer is quantized and packed as it is added; `dtype` is
        then the one its products take rows in."""
        if dtype not in STORAGE_DTYPES:
            raise StoreError(f"unsupported storage dtype {dtype!r}; use one of {sorted(STORAGE_DTYPES)}")
        if quant is not None and quant not in FORMATS:
            raise StoreError(f"unknown quantized format {quant!r}; use one of {list(FORMATS)}")
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.dtype, self.quant = dtype, quant
        self.manifest = {
            "format": FORMAT_NAME,
            "layout_version": LAYOUT_VERSION if quant is None else QUANTIZED_LAYOUT_VERSION,
            "dtype": dtype,
            **({"quant": quant} if quant else {}),
            "layers": {},
        }

    def add_layer(self, layer: int, w13: np.ndarray, w2: np.ndarray):
        experts = LayerExperts(w13.astype(STORAGE_DTYPES[self.dtype]), w2.astype(STORAGE_DTYPES[self.dtype]))
        experts.validate(f"layer {layer}")
        if self.quant is not None:
            self.add_quantized_layer(layer, quantize_layer(experts, self.quant, f"layer {layer}"))
        else:
            self._write_layer(layer, w13, w2)

    def add_quantized_layer(self, layer: int, quantized: QuantizedLayerExperts):
        """A layer already quantized in this store's format (quantize_layer's or pack_int4_layer's)."""
        if quantized.quant != self.quant:
            raise StoreError(f"layer {layer}: {quantized.quant} experts in a {self.quant} store")
        sizes = {"hidden": quantized.hidden, "ffn": quantized.ffn}
        if any(self.manifest.setdefault(key, v) != v for key, v in sizes.items()):
            raise StoreError(f"layer {layer}: sizes {sizes} differ from the store's earlier layers")
        self._write_layer(layer, quantized.w13_packed, quantized.w2_packed)

    def _write_layer(self, layer: int, w13: np.ndarray, w2: np.ndarray):
        entry = {}
        for name, array in (("w13", w13), ("w2", w2)):
            file = f"layer{layer:04d}.{name}.bin"
            data = np.ascontiguousarray(array, dtype=STORAGE_DTYPES[self.dtype] if self.quant is None else np.uint8)
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


def release_pages(array: np.ndarray):
    """madvise(MADV_DONTNEED) on the file mapping under a np.memmap (or a view of one): its resident pages leave the
    process's memory, to be read again from the file if touched (so every array stays valid). Nothing for arrays
    that map no file."""
    _advise(array, "MADV_DONTNEED")


def _advise(array: np.ndarray, advice: str):
    """madvise(`advice`) on the whole file mapping under a np.memmap or a view of one, where this OS has it."""
    while isinstance(array, np.ndarray) and not isinstance(array, np.memmap):
        array = array.base
    mapping = getattr(array, "_mmap", None)
    if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, advice):
        mapping.madvise(getattr(mmap, advice))


def file_sha256(file) -> str:
    """SHA-256 hex digest of a file's content, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
