"""The jitted model's direct call into the host's fused expert forward: an XLA FFI custom call.

`moe_jax/_xla_ffi` (built from moe_jax/csrc/xla_host_experts.c by `pip install`) holds the handler; registered
once per process as "moe_jax_host_experts" for the CPU platform. Each call site passes the address of its layer's
`moe_call` (host_kernels/fused_forward.py) as an attribute, so XLA calls the native forward on its own buffers:
no Python, no GIL, no copies. Where the handler is not built, is turned off (MOE_JAX_XLA_FFI=0), or the jitted step
runs on an accelerator (the handler serves XLA:CPU only), the host backend calls the same fused forward through
`jax.pure_callback` instead (~125 us more per call on this CPU).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import jax
import numpy as np

from host_kernels import native
from host_kernels.native_sources import xla_ffi_source_hash

TARGET = "moe_jax_host_experts"


def status() -> tuple[bool, str]:
    """(usable, why not): the handler is built from the current sources, registered, and not turned off."""
    if os.environ.get("MOE_JAX_XLA_FFI", "1") == "0":
        return False, "MOE_JAX_XLA_FFI=0"
    if jax.default_backend() != "cpu":  # the handler is registered for XLA:CPU; an accelerator's step calls back
        return False, f"the model runs on {jax.default_backend()}; the handler serves XLA:CPU steps"
    return _registered()


@cache
def _registered() -> tuple[bool, str]:
    path = native.extension_path(Path(__file__).resolve().parents[1], "_xla_ffi")
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
    _registered.library = library  # keep it loaded while XLA holds its function
    return True, ""


def host_experts_call(call_address: int, x_td, ids_tk, weights_tk):
    """y = the routed experts of the layer whose moe_call is at `call_address`, computed on the host."""
    result = jax.ShapeDtypeStruct(x_td.shape, x_td.dtype)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(x_td, ids_tk, weights_tk, call=np.uint64(call_address))
