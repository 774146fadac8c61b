"""A greedy decode step's tokens: each row's first maximum of float32 logits (host_kernels/csrc/xla_argmax.c)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.native import ffi

TARGET = "moe_jax_argmax"
CPU_FLAGS = ("avx512f",)  # the kernel's target


def status() -> tuple[bool, str]:
    """(usable, why not) for the native argmax."""
    return ffi.kernel_status(CPU_FLAGS)


def argmax_tokens(logits_bv, native: bool):
    """Each row's first maximum, int32 [b, 1]: with `native` (the plan's choice) the native handler for float32
    logits (NaN counts as the maximum, as in jnp.argmax), else jnp.argmax."""
    if logits_bv.dtype != jnp.float32 or not native:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)[:, None]
    ffi.require(status(), "argmax")
    result = jax.ShapeDtypeStruct((logits_bv.shape[0], 1), jnp.int32)
    return jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")(logits_bv)
