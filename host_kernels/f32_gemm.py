"""float32 GEMMs for the fused forward of float32 stores, on AVX-512 FMA (host_kernels/csrc/f32_gemm.c) or AVX2 +
FMA (csrc/avx2_gemm.c), and the packed layout both read: column blocks of 32, each one contiguous stream
[n blocks][k][32], zero-padded.

`status(isa)` says whether this machine can run a variant (its CPU features and the native library) and, if not,
why.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels import native
from host_kernels.activations import NATIVE_CPU_FLAGS
from host_kernels.amx import aligned_empty, padded
from host_kernels.errors import KernelArgumentError

N_BLOCK = 32  # columns per packed block (two AVX-512 registers)


@dataclass(frozen=True)
class PackedF32:
    data: np.ndarray  # [n blocks, k, 32] float32, 64-byte aligned
    k: int
    n: int

    def __post_init__(self):
        self.validate()

    def validate(self, what: str = "packed weight"):
        """The data is exactly what k and n say (a hand-built one that is not would make `gemm` read past it);
        checked when made, so `gemm` need not check it again."""
        native.check_packed(what, self.data, np.float32, (padded(self.n, N_BLOCK) // N_BLOCK, self.k, N_BLOCK))


def pack(w: np.ndarray, empty=aligned_empty) -> PackedF32:
    """A [k, n] weight (any float dtype, widened to float32) in column blocks of 32, in an array from `empty`."""
    k, n = w.shape
    blocks = padded(n, N_BLOCK) // N_BLOCK
    data = empty((blocks, k, N_BLOCK), np.float32)
    full = np.zeros((k, blocks * N_BLOCK), np.float32)
    full[:, :n] = w
    data[...] = full.reshape(k, blocks, N_BLOCK).transpose(1, 0, 2)
    return PackedF32(data, k, n)


def gemm(
    a: np.ndarray, w: PackedF32, out: np.ndarray, n0: int = 0, n1: int | None = None, isa: str | None = None
) -> np.ndarray:
    """out[:, :] = (a @ w)[:, n0:n1] for float32 rows `a` [m, k] (unit column stride); n0 a multiple of 32. `isa`:
    the variant (native.AVX512, native.AVX2; default: the fastest this CPU runs)."""
    isa = native.pick_isa(native.variant_statuses(CPU_FLAGS), isa, "float32 GEMM")
    n1 = w.n if n1 is None else n1
    m = a.shape[0]
    if a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != w.k or a.strides[1] != 4 or a.strides[0] < 0:
        raise KernelArgumentError(f"rows are {a.dtype} {a.shape}, expected float32 [m, {w.k}] with contiguous columns")
    native.check_gemm_output(out, m, n0, n1, w.n, N_BLOCK)
    getattr(native.lib(), native.symbol("f32_gemm", isa))(
        a.ctypes.data, a.strides[0] // 4, w.data.ctypes.data, w.k, out.ctypes.data, out.strides[0] // 4, m, n0, n1
    )
    return out


CPU_FLAGS = {native.AVX512: NATIVE_CPU_FLAGS, native.AVX2: native.AVX2_CPU_FLAGS}  # each variant's


def status(isa: str = native.AVX512) -> tuple[bool, str]:
    return native.status(CPU_FLAGS[isa])
