"""int8 weights with a float32 scale per output column (symmetric: q = round(w / scale), scale = max|w| / 127 of
the column), for the experts of a quantized store: a quarter of float32's bytes, half of bfloat16's.

Per output column (per expert, per matrix) the scale factors out of every product exactly: x @ (q * s) =
(x @ q) * s, so the kernels multiply once per output and the error is the rounding of each weight alone, at most
half a step: |w - q * s| <= s / 2 = max|w| / 254 of its column.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels.errors import KernelArgumentError

INT8_MAX = 127


@dataclass(frozen=True)
class QuantizedInt8:
    """A [..., k, n] weight as int8 `q` and float32 `scale` [..., n] (one per output column)."""

    q: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        if self.q.dtype != np.int8 or self.scale.dtype != np.float32:
            raise KernelArgumentError(f"quantized weight is {self.q.dtype} with {self.scale.dtype} scales")
        if self.scale.shape != self.q.shape[:-2] + self.q.shape[-1:]:
            raise KernelArgumentError(f"scales {self.scale.shape} do not match int8 weights {self.q.shape}")

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        return (self.q.astype(np.float32) * self.scale[..., None, :]).astype(dtype)


def quantize_int8(w: np.ndarray) -> QuantizedInt8:
    """Symmetric int8 per output column of a [..., k, n] float weight. A column of zeros gets scale 0 (and stays
    zeros); a non-finite weight is refused, naming where it is."""
    w32 = np.asarray(w, np.float32)
    if not np.isfinite(w32).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(w32))[0])
        raise KernelArgumentError(f"weight {w32[where]} at {where} is not finite: it cannot be quantized")
    absmax = np.abs(w32).max(axis=-2)
    scale = (absmax / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)[..., None, :]
    q = np.clip(np.rint(w32 / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return QuantizedInt8(q, scale)
