"""bfloat16 GEMMs on AVX512-BF16 (host_kernels/csrc/bf16_gemm.c), for CPUs with those instructions and no AMX
(AMD Zen 4/5, Intel Cooper Lake), or on AVX2 + FMA (csrc/avx2_gemm.c: the weights widened to float32 in registers)
on CPUs without AVX-512. They read the AMX kernel's packed layout (`amx.pack_layout`), so a bfloat16 store has one
packing whichever of them runs it.

`status(isa)` says whether this machine can run a variant and, if not, why.
"""

from __future__ import annotations

import numpy as np

from host_kernels import native
from host_kernels.amx import N_BLOCK, PackedWeight

CPU_FLAGS = {  # each variant's
    native.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    native.AVX2: native.AVX2_CPU_FLAGS,
}


def status(isa: str = native.AVX512) -> tuple[bool, str]:
    return native.status(CPU_FLAGS[isa])


def gemm(
    a: np.ndarray, w: PackedWeight, out: np.ndarray, n0: int = 0, n1: int | None = None, isa: str | None = None
) -> np.ndarray:
    """out[:, :] = (a @ w)[:, n0:n1] in float32. `a`: bfloat16 rows (uint16) [m, >= w.kp] whose columns past w.k
    are zeros up to w.kp (`amx.pack_rows` or a `amx.row_buffer` make them); `n0` a multiple of 16; `out` a float32
    [m, n1 - n0] array or view with unit column stride. `isa`: the variant (default: the fastest this CPU runs)."""
    run("bf16_gemm", a, w, out, n0, n1, statuses=native.variant_statuses(CPU_FLAGS), isa=isa)
    return out


def run(symbol: str, a: np.ndarray, w, out: np.ndarray, n0: int, n1: int | None, *layout, statuses, isa=None):
    """Calls the packed-weight GEMM `symbol` (bf16_gemm, int8_gemm, or int4_gemm for host_kernels/int8_gemm.py /
    int4_gemm.py: the same arguments, other packed weights, then `layout`'s, such as int4's group size) in the
    variant `isa` or the fastest of `statuses` (isa -> its kernel's status()) this CPU runs, after checking the
    rows and the output. Returns what the kernel returns (int4_gemm: non-zero where it ran out of memory)."""
    isa = native.pick_isa(statuses, isa, f"packed GEMM {symbol}")
    n1 = w.n if n1 is None else n1
    native.check_bf16_rows(a, w.k, w.kp)
    m = a.shape[0]
    native.check_gemm_output(out, m, n0, n1, w.n, N_BLOCK)
    return getattr(native.lib(), native.symbol(symbol, isa))(
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
