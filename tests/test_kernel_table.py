"""The native kernel table (host_kernels/csrc/kernel_table.h) is the one numbering of the kernels: Python's
kernels (host_kernels/fused_forward.py KERNELS) and the C rows agree by name, and every native entry point
refuses a code outside the table."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from host_kernels import KERNELS, kernel_table, native
from host_kernels.errors import HostKernelError
from moe_jax.native import dense, ffi

pytestmark = pytest.mark.skipif(not native.status(())[0], reason=f"no native library: {native.status(())[1]}")


def _python_format(kernel) -> str:
    if kernel.quantized:
        return kernel.format.name.split("-")[0]
    return {32: "f32", 16: "bf16"}[kernel.packed_bits]


def test_python_and_c_tables_agree_by_name():
    rows = kernel_table.rows()
    for name, kernel in KERNELS.items():
        row = rows[kernel.table_name]
        assert (row.isa, row.format) == (name.split("-")[0], _python_format(kernel)), name
        assert (row.bits, row.block) == (kernel.packed_bits, kernel.block), name
        assert kernel.code == row.code == native.lib().moe_kernel_code(kernel.table_name.encode())
    # every C row is reachable from Python, and codes are the table's positions, each once
    assert {k.table_name for k in KERNELS.values()} == set(rows)
    assert sorted(r.code for r in rows.values()) == list(range(native.lib().moe_kernel_count()))


def test_experts_only_formats_are_not_dense_kernels():
    for name, kernel in KERNELS.items():
        row = kernel_table.row(kernel.table_name)
        assert row.dense == (not kernel.quantized or kernel.format.name not in dense.EXPERTS_ONLY_FORMATS), name


def test_unknown_names_and_codes_are_refused():
    with pytest.raises(HostKernelError, match="no kernel 'avx9-int3'"):
        kernel_table.code("avx9-int3")
    library = native.lib()
    out = (ctypes.c_int * 5)()
    assert library.moe_kernel_describe(library.moe_kernel_count(), out) is None
    assert library.moe_kernel_describe(-1, out) is None
    w = np.zeros(1, np.uint64)
    for code in (-1, library.moe_kernel_count(), 99):
        assert not library.moe_layer_new(code, 1, 32, 32, w.ctypes.data, w.ctypes.data, None, 0)


@pytest.mark.skipif(not ffi.status()[0], reason=f"no XLA FFI handlers: {ffi.status()[1]}")
@pytest.mark.parametrize("code", [-1, 99, "avx2-mxfp4"])
def test_the_dense_handler_refuses_codes_it_does_not_run(code):
    if isinstance(code, str):
        code = kernel_table.code(code)  # a real kernel, experts only
    x = jnp.zeros((1, 32), jnp.bfloat16)
    w = jnp.zeros((1, 1, 512), jnp.uint16)
    call = jax.ffi.ffi_call(dense.TARGET, jax.ShapeDtypeStruct((1, 16), jnp.float32))
    with pytest.raises(Exception, match="unknown kernel"):
        jax.block_until_ready(call(x, w, kernel=np.int64(code), group=np.int64(0)))
