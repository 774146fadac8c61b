"""GEMM against stored expert weights, float32 or bfloat16.

bfloat16 weights are widened to float32 one cache-sized block of the contraction dimension at a time and
accumulated, never a whole expert (let alone a layer) at once: the widened block stays in cache for the GEMM.
"""

from __future__ import annotations

import numpy as np

# Widened block size in bytes: about half of a per-core L2, so the block and its GEMM panel both fit.
BLOCK_BYTES = 512 * 1024


def matmul_w(x: np.ndarray, w: np.ndarray, transpose: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """x @ w (or x @ w.T when `transpose`), float32 result; `w` may be bfloat16 storage."""
    if w.dtype == np.float32:
        return np.matmul(x, w.T if transpose else w, out=out)
    if transpose:  # contraction over w's columns
        k, cols = w.shape[1], w.shape[0]
        step = max(1, BLOCK_BYTES // (4 * cols))
        acc = _zeros(x.shape[0], cols, out)
        for k0 in range(0, k, step):
            acc += x[:, k0 : k0 + step] @ w[:, k0 : k0 + step].astype(np.float32).T
        return acc
    k, cols = w.shape
    step = max(1, BLOCK_BYTES // (4 * cols))
    acc = _zeros(x.shape[0], cols, out)
    for k0 in range(0, k, step):
        acc += x[:, k0 : k0 + step] @ w[k0 : k0 + step].astype(np.float32)
    return acc


def _zeros(rows, cols, out):
    if out is None:
        return np.zeros((rows, cols), dtype=np.float32)
    out[...] = 0
    return out
