"""GEMMs over int8 weights with a float32 scale per output column (AVX512-BF16 + VNNI, AMX, AVX2), and the packed
layout they read. bfloat16 rows in, float32 out.

How it works and why: docs/INTERNALS.md, host_kernels/int8_gemm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels import amx, bf16_gemm, native
from host_kernels.amx import K_BLOCK, N_BLOCK, aligned_empty, padded
from host_kernels.errors import HostKernelError, KernelArgumentError
from host_kernels.quant import QuantizedInt8

INTEGER_ROWS = 24  # int8_gemm multiplies up to this many rows as integers (WIDEN_ROWS in csrc/bf16_gemm.c)
SCALE_BYTES = 4 * N_BLOCK  # a block's scales, after its weights


def block_bytes(kp: int) -> int:
    """Bytes of one 16-column block: kp int8 rows of 16 weights, then 16 float32 scales."""
    return kp * N_BLOCK + SCALE_BYTES


@dataclass(frozen=True)
class PackedInt8:
    data: np.ndarray  # uint8 [n blocks, kp * 16 + 64], 64-byte aligned
    k: int
    n: int

    @property
    def kp(self) -> int:
        return padded(self.k, K_BLOCK)

    def __post_init__(self):
        self.validate()

    def validate(self, what: str = "packed int8 weight"):
        """The data is exactly what k and n say; checked when made, so `gemm` need not check it again."""
        shape = (padded(self.n, N_BLOCK) // N_BLOCK, block_bytes(self.kp))
        native.check_packed(what, self.data, np.uint8, shape)


def pack(w: QuantizedInt8, empty=aligned_empty) -> PackedInt8:
    """A [k, n] quantized weight in the packed layout (zeros in the padding, scale 0 for padded columns), in an
    array from `empty`."""
    if w.q.ndim != 2:
        raise KernelArgumentError(f"pack takes one [k, n] weight, got {w.q.shape}")
    k, n = w.q.shape
    kp, np_ = padded(k, K_BLOCK), padded(n, N_BLOCK)
    full = np.zeros((kp, np_), np.int8)
    full[:k, :n] = w.q
    blocks = np_ // N_BLOCK
    pairs = full.reshape(kp // 2, 2, blocks, N_BLOCK).transpose(2, 0, 3, 1)  # [block][k-pair][column][2]
    scales = np.zeros(np_, np.float32)
    scales[:n] = w.scale
    data = empty((blocks, block_bytes(kp)), np.uint8)
    data[:, : kp * N_BLOCK] = pairs.reshape(blocks, kp * N_BLOCK).view(np.uint8)
    data[:, kp * N_BLOCK :] = scales.reshape(blocks, N_BLOCK).view(np.uint8)
    return PackedInt8(data, k, n)


def unpack(w: PackedInt8) -> np.ndarray:
    """The float32 [k, n] weight a packed one holds (q * scale): what its products compute with."""
    blocks, kp = w.data.shape[0], w.kp
    q = w.data[:, : kp * N_BLOCK].view(np.int8).reshape(blocks, kp // 2, N_BLOCK, 2)
    q = q.transpose(1, 3, 0, 2).reshape(kp, blocks * N_BLOCK)[: w.k, : w.n]
    scale = np.ascontiguousarray(w.data[:, kp * N_BLOCK :]).view(np.float32).reshape(-1)[: w.n]
    return q.astype(np.float32) * scale


AMX = "amx"  # the tiles variant's name (its symbol: int8_gemm_amx)


# each variant's: the bfloat16 kernel's, and on AVX-512 VNNI's VPDPWSSD for a few rows (the AMX variant streams
# those with the AVX-512 one)
CPU_FLAGS = {
    native.AVX512: bf16_gemm.CPU_FLAGS[native.AVX512] + ("avx512_vnni",),
    native.AVX2: bf16_gemm.CPU_FLAGS[native.AVX2],
}


def status(isa: str = native.AVX512) -> tuple[bool, str]:
    if isa == AMX:
        usable, why = amx.status()
        return (usable, why) if not usable else status(native.AVX512)
    return native.status(CPU_FLAGS[isa])


def statuses() -> dict[str, tuple[bool, str]]:
    """Each variant's status, fastest first."""
    return {AMX: status(AMX), **native.variant_statuses(CPU_FLAGS)}


def gemm(
    a: np.ndarray, w: PackedInt8, out: np.ndarray, n0: int = 0, n1: int | None = None, isa: str | None = None
) -> np.ndarray:
    """out[:, :] = (a @ dequantized w)[:, n0:n1] in float32. `a`: bfloat16 rows (uint16) [m, >= w.kp] whose columns
    past w.k are zeros up to w.kp; `n0` a multiple of 16; `out` float32 [m, n1 - n0] with unit column stride.
    `isa`: the variant (default: the fastest this CPU runs)."""
    if bf16_gemm.run("int8_gemm", a, w, out, n0, n1, statuses=statuses(), isa=isa):
        raise HostKernelError(f"int8 GEMM: out of memory for {a.shape[0]} quantized rows")
    return out
