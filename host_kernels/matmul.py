"""GEMM against stored expert weights, float32 or bfloat16.

bfloat16 weights are widened to float32 one cache-sized block of the contraction dimension at a time and
accumulated, never a whole expert (let alone a layer) at once: the widened block stays in cache for the GEMM.
"""

from __future__ import annotations

import numpy as np

# Widened block size in bytes: about half of a per-core L2, so the block and its GEMM panel both fit.
BLOCK_BYTES = 512 * 1024
# Decode-size products (a few rows) fall into OpenBLAS's skinny-GEMM regime, which reads weights at a third of
# the GEMV rate; cutting the weight into column panels of this width roughly doubles the rate for 2-4 rows
# (float32 panels streamed from RAM read faster so).
SKINNY_ROWS = 4
SKINNY_PANEL_COLS = 256


def matmul_w(x: np.ndarray, w: np.ndarray, transpose: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """x @ w (or x @ w.T when `transpose`), float32 result; `w` may be bfloat16 storage."""
    if w.dtype == np.float32:
        if not transpose and 1 < x.shape[0] <= SKINNY_ROWS and w.shape[1] > SKINNY_PANEL_COLS:
            return _panelled(x, w, out)
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


def _panelled(x, w, out):
    out = np.empty((x.shape[0], w.shape[1]), np.float32) if out is None else out
    for c0 in range(0, w.shape[1], SKINNY_PANEL_COLS):
        np.matmul(x, w[:, c0 : c0 + SKINNY_PANEL_COLS], out=out[:, c0 : c0 + SKINNY_PANEL_COLS])
    return out
