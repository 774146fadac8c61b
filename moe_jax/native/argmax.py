"""A greedy decode step's tokens: each row's first maximum of float32 logits (host_kernels/csrc/xla_argmax.c), on
AVX-512 or AVX2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.native import ffi

TARGET = "moe_jax_argmax"
CPU_FLAGS = {"avx512": ("avx512f",), "avx2": ("avx2",)}  # each variant's target, fastest first


def status(isa: str | None = None) -> tuple[bool, str]:
    """(usable, why not) for the native argmax: on `isa`, or on any of its variants."""
    return ffi.variants_status(CPU_FLAGS, isa)


def argmax_tokens(logits_bv, native: bool, isa: str | None = None):
    """Each row's first maximum, int32 [b, 1]: with `native` (the plan's choice) the native handler for float32
    logits (NaN counts as the maximum, as in jnp.argmax; on `isa`, by default the fastest this CPU runs), else
    jnp.argmax."""
    if logits_bv.dtype != jnp.float32 or not native:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)[:, None]
    isa = ffi.fastest(CPU_FLAGS, isa)
    ffi.require(status(isa), f"argmax ({isa})")
    result = jax.ShapeDtypeStruct((logits_bv.shape[0], 1), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(logits_bv, avx512=np.int64(isa == "avx512"))
