"""Reusable, cache-line-aligned scratch buffers: one set for the engine call, one per pool worker.

The engine's temporaries are large (a training-size layer call writes ~100 MB of pre-activations, activations
and gradients) and short-lived. Fresh allocations are fresh pages: the kernel zeroes each one on first touch,
inside the GEMM that writes it. Reusing the pages of the previous call avoids that. A task running on the pool
gets its worker's buffers (workers never share one); outside tasks, the call's. Keyed by worker index rather than
by thread, because the calling thread changes from call to call (XLA runs host callbacks on its own threads).
A name is reused only by the code that owns it: it must be done with a buffer before it asks for that name again,
and calls using one workspace must not overlap (the engine holds a lock).
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
