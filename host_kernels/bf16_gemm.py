"""bfloat16 GEMMs on AVX512-BF16 (host_kernels/csrc/bf16_gemm.c), for CPUs with those instructions and no AMX
(AMD Zen 4/5, Intel Cooper Lake). They read the AMX kernel's packed layout (`amx.pack_layout`), so a bfloat16
store has one packing whichever of the two runs it.

`status()` says whether this machine can run them and, if not, why.
"""

from __future__ import annotations

import numpy as np

from host_kernels import native
from host_kernels.amx import N_BLOCK, PackedWeight

REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def status() -> tuple[bool, str]:
    return native.status(REQUIRED_CPU_FLAGS)


def gemm(a: np.ndarray, w: PackedWeight, out: np.ndarray, n0: int = 0, n1: int | None = None) -> np.ndarray:
    """out[:, :] = (a @ w)[:, n0:n1] in float32. `a`: bfloat16 rows (uint16) [m, >= w.kp] whose columns past w.k
    are zeros up to w.kp (`amx.pack_rows` or a `amx.row_buffer` make them); `n0` a multiple of 16; `out` a float32
    [m, n1 - n0] array or view with unit column stride."""
    run("bf16_gemm", a, w, out, n0, n1)
    return out


def run(symbol: str, a: np.ndarray, w, out: np.ndarray, n0: int, n1: int | None, *layout, usable=None):
    """Calls the packed-weight GEMM `symbol` (bf16_gemm, int8_gemm, or int4_gemm for host_kernels/int8_gemm.py /
    int4_gemm.py: the same arguments, other packed weights, then `layout`'s, such as int4's group size) after
    checking the CPU (`usable`: its kernel's status(), by default this file's), the rows and the output. Returns
    what the kernel returns (int4_gemm: non-zero where it ran out of memory)."""
    native.require(status() if usable is None else usable, f"packed GEMM {symbol}")
    n1 = w.n if n1 is None else n1
    native.check_bf16_rows(a, w.k, w.kp)
    m = a.shape[0]
    native.check_gemm_output(out, m, n0, n1, w.n, N_BLOCK)
    return getattr(native.lib(), symbol)(
        a.ctypes.data,
        a.strides[0] // 2,
        w.data.ctypes.data,
        w.kp,
        out.ctypes.data,
        out.strides[0] // 4,
        m,
        n0,
        n1,
        *layout,
    )
