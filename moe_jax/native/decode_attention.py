"""A decode step's attention over a bfloat16 or float32 KV cache, the new entries written in place
(host_kernels/csrc/xla_decode_attention.c), on AVX-512 or AVX2 + FMA."""

from __future__ import annotations

import jax
import numpy as np

from moe_jax.native import ffi

TARGET = "moe_jax_decode_attention"
CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "fma"), "avx2": ("avx2", "fma")}  # fastest first


def status(isa: str | None = None) -> tuple[bool, str]:
    """(usable, why not) for the native decode attention: on `isa`, or on any of its variants."""
    return ffi.variants_status(CPU_FLAGS, isa)


def decode_attention_call(
    q_bkgd, k_new_bk1d, v_new_bk1d, positions_b1, k_cache, v_cache, window: int | None, isa: str | None = None
):
    """One decode step's attention (arrays all bfloat16 or all float32, the model's dtype): (out [b, kv, g, d],
    k_cache, v_cache) with the new entries written at `positions_b1`; the caches are aliased to the results, so a
    donated cache is updated in place. On `isa`, by default the fastest variant this CPU runs."""
    isa = ffi.fastest(CPU_FLAGS, isa)
    ffi.require(status(isa), f"decode attention ({isa})")
    results = (
        jax.ShapeDtypeStruct(q_bkgd.shape, q_bkgd.dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    )
    call = jax.ffi.ffi_call(TARGET, results, input_output_aliases={4: 1, 5: 2}, vmap_method="sequential")
    positions = positions_b1.astype(np.int32)
    return call(
        q_bkgd, k_new_bk1d, v_new_bk1d, positions, k_cache, v_cache,
        window=np.int64(window or 0), avx512=np.int64(isa == "avx512"),
    )  # fmt: skip
