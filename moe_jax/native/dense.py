"""A decode step's dense products (attention projections, the head) over weights packed for the host kernels:
bfloat16 on AMX or AVX512-BF16 / AVX2, int8 or int4 (host_kernels/csrc/xla_dense.c)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from host_kernels import BF16, KERNELS, best_kernel
from moe_jax.native import ffi

TARGET = "moe_jax_dense"
MAX_ROWS = 64  # a decode step's batch, 16 rows (an AMX tile) at a time
# the fused forward's bfloat16 and quantized kernels (host_kernels/fused_forward.py KERNELS, which say how to pack
# for them, int4's group and whether this machine runs them) -> xla_dense.c's DENSE_* codes, by (instruction set:
# a kernel name's first part, bits per packed weight)
_CODES_BY_KIND = {
    ("avx512", 16): 0, ("amx", 16): 1, ("avx512", 8): 2, ("avx512", 4): 3, ("avx2", 16): 4, ("avx2", 8): 5,
    ("avx2", 4): 6,
}  # fmt: skip
CODES = {
    name: _CODES_BY_KIND[name.split("-")[0], kernel.packed_bits]
    for name, kernel in KERNELS.items()
    if kernel.packed_bits < 32  # float32 weights: XLA's own products
}


def dense_kernel(quant: str | None = None) -> tuple[str, str]:
    """(kernel, "") for the native dense products on this machine, after the handlers' status: the fastest
    bfloat16 kernel the fused forward would pick (AMX tiles, else AVX512-BF16), or with `quant` the one for those
    quantized weights; or ("", why none)."""
    usable, reason = ffi.status()
    return best_kernel(BF16, quant) if usable else ("", reason)


def pack_dense(w_kn, kernel: str) -> jax.Array:
    """A [k, n] weight packed for `kernel` (as the fused forward packs for it: bfloat16 in the AMX tile layout,
    which the AVX512-BF16 kernel reads too, int8 with a scale per column, or int4 with one per group)."""
    k = KERNELS[kernel]
    return jnp.asarray(k.pack(np.asarray(w_kn, k.pack_dtype)).data)


def dense_call(x_mk, packed_w, n: int, kernel: str):
    """x @ W in float32 for x bfloat16 [m <= MAX_ROWS, k], W given as `pack_dense(W, kernel)` with n columns,
    on `kernel` (`dense_kernel()`'s answer, which the plan recorded)."""
    usable, reason = KERNELS[kernel].status() if kernel in CODES else (False, f"unknown kernel {kernel!r}")
    ffi.require((usable, reason), f"dense products on {kernel}")
    ffi.require(ffi.status(), f"dense products on {kernel}")  # registers the handler on first use
    result = jax.ShapeDtypeStruct((x_mk.shape[0], n), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(x_mk, packed_w, kernel=np.int64(CODES[kernel]), group=np.int64(KERNELS[kernel].group))
