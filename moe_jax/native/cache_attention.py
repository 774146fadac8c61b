"""The attention of a step's new tokens (one a row at decode, many at prefill) to a bfloat16 or float32 KV cache,
the new entries written in place (host_kernels/csrc/xla_cache_attention.c), on AVX-512 or AVX2 + FMA."""

from __future__ import annotations

import jax
import numpy as np

from moe_jax.native import ffi

TARGET = "moe_jax_cache_attention"
CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "fma"), "avx2": ("avx2", "fma")}  # fastest first


def status(isa: str | None = None) -> tuple[bool, str]:
    """(usable, why not) for the native cache attention: on `isa`, or on any of its variants."""
    return ffi.variants_status(CPU_FLAGS, isa)


def cache_attention_call(
    q_bktgd, k_new_bktd, v_new_bktd, positions_bt, k_cache, v_cache, window: int | None, isa: str | None = None
):
    """A step's attention (arrays all bfloat16 or all float32, the model's dtype; queries kv-head-major as
    `layers.attend` takes them): (out [b, kv, t, g, d], k_cache, v_cache) with the new entries written at
    `positions_bt` (each row's consecutive, its first inside the cache; those past its end are right padding, not
    written) and each token attending to the cache entries up to its position; the caches are aliased to the
    results, so a donated cache is updated in place. On `isa`, by default the fastest variant this CPU runs."""
    isa = ffi.fastest(CPU_FLAGS, isa)
    ffi.require(status(isa), f"cache attention ({isa})")
    results = (
        jax.ShapeDtypeStruct(q_bktgd.shape, q_bktgd.dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    )
    call = jax.ffi.ffi_call(TARGET, results, input_output_aliases={4: 1, 5: 2}, vmap_method="sequential")
    positions = positions_bt.astype(np.int32)
    return call(
        q_bktgd, k_new_bktd, v_new_bktd, positions, k_cache, v_cache,
        window=np.int64(window or 0), avx512=np.int64(isa == "avx512"),
    )  # fmt: skip
