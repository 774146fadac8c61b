"""Generation's dense products (attention projections, the head) over weights packed for the host kernels: bfloat16 on
AMX or AVX512-BF16 / AVX2, int8 or int4, float32 on AVX-512 or AVX2 (host_kernels/csrc/xla_dense.c).

How it works and why: docs/INTERNALS.md, moe_jax/native/dense.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from host_kernels import BF16, KERNELS, HugePageArena, aligned_empty, best_kernel, kernel_table
from moe_jax.native import ffi

TARGET = "moe_jax_dense"
MAX_ROWS = 64  # a decode step's batch, 16 rows (an AMX tile) at a time
PREFILL_MAX_ROWS = 8192  # a prefill's rows (batch x positions); xla_dense.c copies x, padded, for the kernels


def dense_kernel(dtype=BF16, quant: str | None = None) -> tuple[str, str]:
    """(kernel, "") for the native dense products of a `dtype` model on this machine, after the handlers' status:
    the fastest kernel the fused forward would pick for such weights (bfloat16: AMX tiles, else AVX512-BF16, else
    AVX2; float32: AVX-512, else AVX2), or with `quant` the one for those quantized weights whatever `dtype` (as
    llama.cpp's Q8_0 / Q4_0 files hold every product's weights quantized; a float32 model's rows are rounded to
    the kernels' bfloat16 for them, `takes`), except MXFP4, which quantizes only experts (as GPT-OSS ships and
    llama.cpp's MXFP4 files hold them); or ("", why none)."""
    usable, reason = ffi.status()
    if not usable:
        return "", reason
    if quant in EXPERTS_ONLY_FORMATS:
        quant = None
    return best_kernel(BF16 if quant is not None else dtype, quant)


EXPERTS_ONLY_FORMATS = ("mxfp4",)  # quantized formats that leave the dense weights as they are


def row_dtype(kernel: str):
    """The dtype of the rows `kernel` multiplies (float32 for float32 weights, else bfloat16)."""
    return jnp.float32 if KERNELS[kernel].packed_bits == 32 else jnp.bfloat16


def takes(kernel: str, x, prefill: bool = False) -> bool:
    """Whether `kernel` multiplies the rows x [b, t, k] of its row dtype: a decode step's (t = 1, b between its
    fewest rows and MAX_ROWS) or, with `prefill` (generation's prefill steps, `layers.native_prefill`), any
    positions up to PREFILL_MAX_ROWS rows in all. A quantized kernel takes float32 rows too (as bfloat16)."""
    quantized_rows = KERNELS[kernel].quantized and x.dtype == jnp.float32
    if (x.dtype != row_dtype(kernel) and not quantized_rows) or x.ndim != 3:
        return False
    if x.shape[1] != 1:
        return prefill and x.shape[0] * x.shape[1] <= PREFILL_MAX_ROWS
    return 1 <= x.shape[0] <= MAX_ROWS


def huge_page_packing():
    """An `empty` for `pack_dense` that puts the weights it packs side by side on huge pages: a decode step
    streams them all, and on 4 KB pages the prefetchers stop at every page (host_kernels/huge_pages.py)."""
    return HugePageArena().empty


PACK_COLUMNS = 4096  # columns quantized and packed at once: a whole 151,936-token head's float32 temporaries are GBs


def pack_dense(w_kn, kernel: str, empty=None) -> jax.Array:
    """A [k, n] weight packed for `kernel` (as the fused forward packs for it: bfloat16 in the AMX tile layout,
    which the AVX512-BF16 kernel reads too, int8 with a scale per column, or int4 with one per group), in an
    array from `empty` where given (a HugePageArena's `empty` puts it on huge pages). Every layout is a column
    block after another, so a wide weight is packed PACK_COLUMNS columns at a time into its place."""
    k = KERNELS[kernel]
    empty = empty or aligned_empty
    w_kn = np.asarray(w_kn)
    n = w_kn.shape[1]
    if n <= PACK_COLUMNS:
        data = k.pack(np.asarray(w_kn, k.pack_dtype), empty).data
    else:
        first = k.pack(np.asarray(w_kn[:, :PACK_COLUMNS], k.pack_dtype)).data
        columns = PACK_COLUMNS // first.shape[0]  # a block's columns
        data = empty((-(-n // columns), *first.shape[1:]), first.dtype)
        data[: first.shape[0]] = first
        for start in range(PACK_COLUMNS, n, PACK_COLUMNS):
            part = k.pack(np.asarray(w_kn[:, start : start + PACK_COLUMNS], k.pack_dtype)).data
            data[start // columns : start // columns + part.shape[0]] = part
    # device_put on XLA:CPU takes the aligned packed array as it is, with the huge pages numpy's allocator asked
    # for; jnp.asarray copied it onto 4 KB pages, where the kernels streamed a [2048, 32768] bfloat16 head from
    # DRAM slower
    return jax.device_put(data)


def dense_rows_call(x_mk, packed_w, n: int, kernel: str):
    """`dense_call` for any number of rows: PREFILL_MAX_ROWS at a time (a training step's batch x positions)."""
    if x_mk.shape[0] <= PREFILL_MAX_ROWS:
        return dense_call(x_mk, packed_w, n, kernel)
    parts = range(0, x_mk.shape[0], PREFILL_MAX_ROWS)
    return jnp.concatenate([dense_call(x_mk[r : r + PREFILL_MAX_ROWS], packed_w, n, kernel) for r in parts])


def dense_call(x_mk, packed_w, n: int, kernel: str):
    """x @ W in float32 for x [m <= PREFILL_MAX_ROWS, k] (`row_dtype(kernel)`), W given as `pack_dense(W, kernel)`
    with n columns, on `kernel` (`dense_kernel()`'s answer, which the plan recorded)."""
    usable, reason = KERNELS[kernel].status() if kernel in KERNELS else (False, f"unknown kernel {kernel!r}")
    ffi.require((usable, reason), f"dense products on {kernel}")
    ffi.require(ffi.status(), f"dense products on {kernel}")  # registers the handler on first use
    row = kernel_table.row(KERNELS[kernel].table_name)
    ffi.require((row.dense, f"{row.format} is an experts-only format"), f"dense products on {kernel}")
    result = jax.ShapeDtypeStruct((x_mk.shape[0], n), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(x_mk, packed_w, kernel=np.int64(row.code), group=np.int64(KERNELS[kernel].group))
