"""The quantized formats of the experts, by name ("int8", "int4", "int4-g64", "int4-g128", "mxfp4"): how a float
weight is quantized and packed for its kernel, the packed array's shape, and how to read it back. One table for everyone
who handles quantized weights: the fused forward's kernels (fused_forward.KERNELS), a quantized store
(store.QuantizedLayerExperts: packed weights written by `moe_jax.convert --quant`, mapped as they are), and the
engine's GEMMs over them (dequantized per expert).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from host_kernels import int4_gemm, int8_gemm, mxfp4_gemm
from host_kernels.amx import K_BLOCK, N_BLOCK, aligned_empty, padded
from host_kernels.quant import INT4_GROUPS, MXFP4_GROUP, quantize_int4, quantize_int8, quantize_mxfp4


@dataclass(frozen=True)
class QuantFormat:
    name: str
    bits: int  # per weight, scales aside
    group: int  # k-rows per scale (0: one scale per column)
    packed_type: type  # PackedInt8 / PackedInt4 / PackedMXFP4
    quantize: Callable  # float [k, n] -> QuantizedInt8 / QuantizedInt4 / QuantizedMXFP4
    pack_quantized: Callable  # quantized -> packed
    block_bytes: Callable[[int], int]  # kp -> bytes of one packed 16-column block
    unpack: Callable  # packed -> float32 [k, n]

    def pack(self, w: np.ndarray, empty=aligned_empty):
        """A float [k, n] weight quantized and packed for this format's kernel (in an array from `empty`)."""
        return self.pack_quantized(self.quantize(w), empty)

    def packed_shape(self, k: int, n: int) -> tuple[int, int]:
        """The packed array's shape (uint8) for a [k, n] weight."""
        return padded(n, N_BLOCK) // N_BLOCK, self.block_bytes(padded(k, K_BLOCK))

    def wrap(self, data: np.ndarray, k: int, n: int):
        """Packed data (say, a view of a mapped store) as this format's packed weight; checked against k and n."""
        return self.packed_type(data, k, n, self.group) if self.group else self.packed_type(data, k, n)


def _int4(group: int) -> QuantFormat:
    return QuantFormat(
        "int4" if group == 32 else f"int4-g{group}", 4, group, int4_gemm.PackedInt4,
        lambda w: quantize_int4(w, group), int4_gemm.pack, lambda kp: int4_gemm.block_bytes(kp, group),
        int4_gemm.unpack,
    )  # fmt: skip


INT8 = QuantFormat(
    "int8", 8, 0, int8_gemm.PackedInt8, quantize_int8, int8_gemm.pack, int8_gemm.block_bytes, int8_gemm.unpack
)
MXFP4 = QuantFormat(
    "mxfp4", 4, MXFP4_GROUP, mxfp4_gemm.PackedMXFP4, quantize_mxfp4, mxfp4_gemm.pack, mxfp4_gemm.block_bytes,
    mxfp4_gemm.unpack,
)  # fmt: skip
FORMATS = {f.name: f for f in (INT8, *(_int4(group) for group in INT4_GROUPS), MXFP4)}
# k-rows per scale -> int4 format name
INT4_BY_GROUP = {f.group: f.name for f in FORMATS.values() if f.packed_type is int4_gemm.PackedInt4}
