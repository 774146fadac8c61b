"""The jitted model's direct calls into native code on XLA:CPU: XLA FFI custom calls.

`moe_jax/_xla_ffi` (built from moe_jax/csrc/ by `pip install`) holds the handlers, registered once per process for
the CPU platform: "moe_jax_host_experts" (the host's fused expert forward), "moe_jax_decode_attention" (a decode
step's attention over a bfloat16 KV cache, written in place; see `decode_attention_status`), "moe_jax_argmax"
(a greedy decode step's tokens; `argmax_tokens`) and "moe_jax_dense" (a decode step's dense bfloat16 products on
AMX or AVX512-BF16, over weights packed for them; `dense_kernel`).

For the experts, each call site passes the address of its layer's `moe_call` (host_kernels/fused_forward.py) as an
attribute, so XLA calls the native forward on its own buffers: no Python, no GIL, no copies. Where the handlers are
not built, are turned off (the execution plan, moe_jax/plan.py), or the jitted step runs on an accelerator (they
serve XLA:CPU only), the host backend calls the same fused forward through `jax.pure_callback` instead (~125 us
more per call on this CPU), and attention and argmax stay in XLA.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from host_kernels import KernelArgumentError, amx, is_live_call, native
from host_kernels.fused_forward import KERNELS, best_kernel
from host_kernels.native_sources import xla_ffi_source_hash

TARGET = "moe_jax_host_experts"
ATTENTION_TARGET = "moe_jax_decode_attention"
ATTENTION_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "fma")  # the kernel's target (xla_decode_attention.c)
ARGMAX_TARGET = "moe_jax_argmax"
ARGMAX_CPU_FLAGS = ("avx512f",)  # xla_argmax.c's target
DENSE_TARGET = "moe_jax_dense"
DENSE_MAX_ROWS = 64  # a decode step's batch, 16 rows (an AMX tile) at a time
# the dense handler's kernels (the fused forward's bfloat16 and quantized ones, host_kernels/fused_forward.py
# KERNELS, which say how to pack for them, int4's group and whether this machine runs them) -> xla_dense.c's codes
# xla_dense.c's DENSE_* by (instruction set: a kernel name's first part, bits per packed weight)
_DENSE_CODES_BY_KIND = {
    ("avx512", 16): 0, ("amx", 16): 1, ("avx512", 8): 2, ("avx512", 4): 3, ("avx2", 16): 4, ("avx2", 8): 5,
    ("avx2", 4): 6,
}  # fmt: skip
DENSE_CODES = {
    name: _DENSE_CODES_BY_KIND[name.split("-")[0], kernel.packed_bits]
    for name, kernel in KERNELS.items()
    if kernel.packed_bits < 32  # float32 weights: XLA's own products
}


def status() -> tuple[bool, str]:
    """(usable, why not): the steps run on XLA:CPU and the handlers are built from the current sources and
    registered. Whether they are used is the execution plan's decision (moe_jax/plan.py)."""
    if jax.default_backend() != "cpu":  # the handler is registered for XLA:CPU; an accelerator's step calls back
        return False, f"the model runs on {jax.default_backend()}; the handler serves XLA:CPU steps"
    return _registered()


@cache
def _registered() -> tuple[bool, str]:
    path = native.extension_path(Path(__file__).resolve().parent, "_xla_ffi")
    if path is None:
        return (
            False,
            "moe_jax._xla_ffi not built (reinstall with `pip install -e .`: it needs jaxlib's headers and gcc)",
        )
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        return False, f"cannot load {path.name}: {e}"
    reason = native.built_from_sources(library, "xla_ffi_source_hash", xla_ffi_source_hash, path)
    if reason:
        return False, reason
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.moe_jax_host_experts), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(library.moe_jax_decode_attention), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(library.moe_jax_argmax), platform="cpu")
    jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(library.moe_jax_dense), platform="cpu")
    _registered.library = library  # keep it loaded while XLA holds its function
    return True, ""


def host_experts_call(call_address: int, x_td, ids_tk, weights_tk):
    """y = the routed experts of the layer whose moe_call is at `call_address`, computed on the host."""
    if not is_live_call(call_address):
        raise KernelArgumentError(f"{call_address:#x} is not the moe_call of a live fused forward")
    result = jax.ShapeDtypeStruct(x_td.shape, x_td.dtype)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(x_td, ids_tk, weights_tk, call=np.uint64(call_address))


def _kernel_status(cpu_flags) -> tuple[bool, str]:
    """(usable, why not) for a handler whose kernel needs `cpu_flags`: the handlers' status, then the CPU's."""
    usable, reason = status()
    if not usable:
        return usable, reason
    lacking = native.cpu_lacks(cpu_flags)
    return not lacking, lacking


def decode_attention_status() -> tuple[bool, str]:
    """(usable, why not) for the native decode attention."""
    return _kernel_status(ATTENTION_CPU_FLAGS)


def argmax_status() -> tuple[bool, str]:
    """(usable, why not) for the native argmax."""
    return _kernel_status(ARGMAX_CPU_FLAGS)


def dense_kernel(quant: str | None = None) -> tuple[str, str]:
    """(kernel, "") for the native dense products on this machine, after the handlers' status: the fastest
    bfloat16 kernel the fused forward would pick (AMX tiles, else AVX512-BF16), or with `quant` the one for those
    quantized weights; or ("", why none)."""
    usable, reason = status()
    return best_kernel(amx.BF16, quant) if usable else ("", reason)


def pack_dense(w_kn, kernel: str) -> jax.Array:
    """A [k, n] weight packed for `kernel` (as the fused forward packs for it: bfloat16 in the AMX tile layout,
    which the AVX512-BF16 kernel reads too, int8 with a scale per column, or int4 with one per group)."""
    k = KERNELS[kernel]
    return jnp.asarray(k.pack(np.asarray(w_kn, k.pack_dtype)).data)


def dense_call(x_mk, packed_w, n: int, kernel: str):
    """x @ W in float32 for x bfloat16 [m <= DENSE_MAX_ROWS, k], W given as `pack_dense(W, kernel)` with n columns,
    on `kernel` (`dense_kernel()`'s answer, which the plan recorded)."""
    usable, reason = KERNELS[kernel].status() if kernel in DENSE_CODES else (False, f"unknown kernel {kernel!r}")
    if not usable or not status()[0]:  # status() registers the handler on first use
        raise RuntimeError(f"native dense products on {kernel} unavailable: {reason or status()[1]}")
    result = jax.ShapeDtypeStruct((x_mk.shape[0], n), jnp.float32)
    call = jax.ffi.ffi_call(DENSE_TARGET, result, vmap_method="sequential")
    return call(x_mk, packed_w, kernel=np.int64(DENSE_CODES[kernel]), group=np.int64(KERNELS[kernel].group))


def argmax_tokens(logits_bv, native: bool):
    """Each row's first maximum, int32 [b, 1]: with `native` (the plan's choice) the native handler for float32
    logits (NaN counts as the maximum, as in jnp.argmax), else jnp.argmax."""
    if logits_bv.dtype != jnp.float32 or not native:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)[:, None]
    usable, reason = argmax_status()  # registers the handler on first use
    if not usable:
        raise RuntimeError(f"native argmax unavailable: {reason}")
    result = jax.ShapeDtypeStruct((logits_bv.shape[0], 1), jnp.int32)
    return jax.ffi.ffi_call(ARGMAX_TARGET, result, vmap_method="sequential")(logits_bv)


def decode_attention_call(q_bkgd, k_new_bk1d, v_new_bk1d, positions_b1, k_cache, v_cache, window: int | None):
    """One decode step's attention (bfloat16): (out [b, kv, g, d], k_cache, v_cache) with the new entries written
    at `positions_b1`; the caches are aliased to the results, so a donated cache is updated in place."""
    usable, reason = decode_attention_status()  # registers the handler on first use
    if not usable:
        raise RuntimeError(f"native decode attention unavailable: {reason}")
    results = (
        jax.ShapeDtypeStruct(q_bkgd.shape, q_bkgd.dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    )
    call = jax.ffi.ffi_call(ATTENTION_TARGET, results, input_output_aliases={4: 1, 5: 2}, vmap_method="sequential")
    positions = positions_b1.astype(np.int32)
    return call(q_bkgd, k_new_bk1d, v_new_bk1d, positions, k_cache, v_cache, window=np.int64(window or 0))
