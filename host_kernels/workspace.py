"""Reusable, cache-line-aligned scratch buffers: one set for the engine call, one per pool worker.

How it works and why: docs/INTERNALS.md, host_kernels/workspace.py.
"""

from __future__ import annotations

import numpy as np

from host_kernels.amx import aligned_empty
from host_kernels.pool import current_worker


class Workspace:
    def __init__(self):
        self._buffers: dict[tuple, np.ndarray] = {}

    def get(self, name: str, shape, dtype) -> np.ndarray:
        """An uninitialised array of `shape` and `dtype` in buffer `name` of the current worker (grown as needed)."""
        key = (current_worker(), name)
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buffer = self._buffers.get(key)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._buffers[key] = aligned_empty((max(nbytes, 1),), np.uint8)
        return buffer[:nbytes].view(dtype).reshape(shape)
