"""Long-lived weight arrays on transparent huge pages (2 MB), carved from large anonymous mappings.

How it works and why: docs/INTERNALS.md, host_kernels/huge_pages.py.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # mapped at a time (virtual: pages become resident as arrays are written)
ALIGNMENT = 64  # a cache line, as amx.aligned_empty


class HugePageArena:
    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: np.ndarray | None = None  # uint8 view of the current chunk's 2 MB-aligned part
        self._used = 0

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array, 64-byte aligned, in the arena (as amx.aligned_empty, whose
        signature it shares, so packers take either)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if self._chunk is None or start + nbytes > self._chunk.size:
            self._chunk, start = _map_chunk(max(self.chunk_bytes, nbytes)), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes].view(dtype).reshape(shape)


def _map_chunk(nbytes: int) -> np.ndarray:
    """`nbytes` (rounded up to whole huge pages) of a fresh anonymous mapping, starting on a 2 MB boundary; the
    mapping stays alive as long as any view of it does."""
    nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the pages are the OS's default
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mapping, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes]
