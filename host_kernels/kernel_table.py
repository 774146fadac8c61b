"""The native kernel table (host_kernels/csrc/kernel_table.h), read from the library: the one numbering of the GEMM
kernels over packed weights. Python names a kernel; its code is looked up here by that name, so no Python file
writes a kernel's number. An unknown name or code is an error."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

from host_kernels import native
from host_kernels.errors import HostKernelError

ISAS = ("avx512", "amx", "avx2")  # MOE_ISA_*, by value
FORMATS = ("f32", "bf16", "int8", "int4", "mxfp4")  # MOE_FORMAT_*, by value


@dataclass(frozen=True)
class KernelRow:
    """One row of the C table."""

    code: int
    name: str  # e.g. "avx2-int4": int4's kernels serve every group
    isa: str
    format: str
    bits: int  # per packed weight, scales aside
    block: int  # columns per packed block
    dense: bool  # the dense products' handler (xla_dense.c) runs it


@cache
def rows() -> dict[str, KernelRow]:
    """Every row of the library's table, by name."""
    library = native.lib()
    table = {}
    for code in range(library.moe_kernel_count()):
        out = (ctypes.c_int * 5)()
        name = library.moe_kernel_describe(code, out).decode()
        isa, fmt, bits, block, dense = out
        table[name] = KernelRow(code, name, ISAS[isa], FORMATS[fmt], bits, block, bool(dense))
    return table


def row(name: str) -> KernelRow:
    """The row of the kernel called `name`, found by the library's own lookup."""
    code = native.lib().moe_kernel_code(name.encode())
    if code < 0:
        raise HostKernelError(f"the native library has no kernel {name!r} (it has {', '.join(rows())})")
    return next(r for r in rows().values() if r.code == code)


def code(name: str) -> int:
    """The kernel table's code of `name`."""
    return row(name).code
