"""GEMMs over MXFP4 weights (GPT-OSS's expert format: e2m1 values with an e8m0 power of two per 32 k-rows and
column) on AVX512-VNNI (host_kernels/csrc/int4_gemm.c) or AVX2 (csrc/avx2_quantized_gemm.c), and the layout they
read: int4_gemm.py's with group 32, each nibble an e2m1 code instead of q + 8 and each group's 32 scale bytes its
16 columns' e8m0 exponents then 16 zeros. The codes and exponents are kept as they arrive, so MXFP4 weights from a
GPT-OSS checkpoint or a GGUF file compute with exactly their values. Activations as for int4: bfloat16 rows
quantized to int8 per 32 values by the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels import bf16_gemm, int4_gemm, native
from host_kernels.amx import K_BLOCK, N_BLOCK, aligned_empty, padded
from host_kernels.errors import HostKernelError, KernelArgumentError
from host_kernels.quant import MXFP4_GROUP, QuantizedMXFP4

CPU_FLAGS = {
    native.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    native.AVX2: native.AVX2_CPU_FLAGS,
}


def block_bytes(kp: int) -> int:
    return int4_gemm.block_bytes(kp, MXFP4_GROUP)


@dataclass(frozen=True)
class PackedMXFP4:
    data: np.ndarray  # uint8 [n blocks, block_bytes(kp)], 64-byte aligned
    k: int
    n: int
    group: int = MXFP4_GROUP

    @property
    def kp(self) -> int:
        return padded(self.k, K_BLOCK)

    def __post_init__(self):
        self.validate()

    def validate(self, what: str = "packed MXFP4 weight"):
        shape = (padded(self.n, N_BLOCK) // N_BLOCK, block_bytes(self.kp))
        native.check_packed(what, self.data, np.uint8, shape)


def pack(w: QuantizedMXFP4, empty=aligned_empty) -> PackedMXFP4:
    """A [k, n] MXFP4 weight in the packed layout (code 0, +0, in the padding), in an array from `empty`."""
    if w.codes.ndim != 2:
        raise KernelArgumentError(f"pack takes one [k, n] weight, got {w.codes.shape}")
    k, n = w.codes.shape
    kp, np_ = padded(k, K_BLOCK), padded(n, N_BLOCK)
    codes = np.zeros((kp, np_), np.uint8)
    codes[:k, :n] = w.codes
    groups = kp // MXFP4_GROUP
    scales = np.zeros((groups, np_ // N_BLOCK, int4_gemm.SCALE_BYTES), np.uint8)  # [group][block][32 bytes]
    exponents = np.zeros((groups, np_), np.uint8)
    exponents[: w.exponents.shape[0], :n] = w.exponents
    scales[..., :N_BLOCK] = exponents.reshape(groups, -1, N_BLOCK)
    data = empty((np_ // N_BLOCK, block_bytes(kp)), np.uint8)
    int4_gemm.write_layout(data, codes, scales.transpose(1, 0, 2), MXFP4_GROUP)
    return PackedMXFP4(data, k, n)


def codes_and_exponents(w: PackedMXFP4) -> QuantizedMXFP4:
    """The codes and exponents a packed weight holds (what `pack` was given)."""
    codes, scales = int4_gemm.read_layout(w.data, w.kp, MXFP4_GROUP)
    exponents = scales[:, :, :N_BLOCK].transpose(1, 0, 2).reshape(w.kp // MXFP4_GROUP, -1)
    return QuantizedMXFP4(np.ascontiguousarray(codes[: w.k, : w.n]), np.ascontiguousarray(exponents[:, : w.n]))


def unpack(w: PackedMXFP4) -> np.ndarray:
    """The float32 [k, n] weight a packed one holds: what its products compute with."""
    return codes_and_exponents(w).dequantize()


def status(isa: str = native.AVX512) -> tuple[bool, str]:
    return native.status(CPU_FLAGS[isa])


def gemm(
    a: np.ndarray, w: PackedMXFP4, out: np.ndarray, n0: int = 0, n1: int | None = None, isa: str | None = None
) -> np.ndarray:
    """out[:, :] = (a @ dequantized w)[:, n0:n1] in float32, as int4_gemm.gemm."""
    statuses = native.variant_statuses(CPU_FLAGS)
    if bf16_gemm.run("mxfp4_gemm", a, w, out, n0, n1, statuses=statuses, isa=isa):
        raise HostKernelError(f"MXFP4 GEMM: out of memory for {a.shape[0]} quantized rows")
    return out
