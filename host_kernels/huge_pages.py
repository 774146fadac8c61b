"""Long-lived weight arrays on transparent huge pages (2 MB), carved from large anonymous mappings.

A decode step streams each routed expert's packed weights once; on 4 KB pages the hardware prefetchers stop at
every page boundary and each page costs a TLB walk. numpy asks for huge pages only for allocations of 4 MB and more,
and malloc serves many of those from heap memory that is already mapped in 4 KB pages: a bfloat16 bench model's
packed experts (1.4-2.8 MB each) sat on no huge page at all, a float32 one's on about two thirds. An arena
maps chunks of at least `CHUNK_BYTES`, 2 MB-aligned and advised MADV_HUGEPAGE, and hands out 64-byte-aligned arrays
from them one after another: packing a layer's experts into one arena puts them on huge pages wherever the kernel
allows it (`/sys/kernel/mm/transparent_hugepage/enabled` "always" or "madvise"; with "never" they are plain pages,
which is what they were before). Arrays are never freed one by one: a chunk is unmapped when the arena and every
array carved from it are gone, so an arena suits weights that live and die together (a layer's).
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
