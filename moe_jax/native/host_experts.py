"""The host experts' custom call: XLA calls the layer's fused forward (host_kernels/fused_forward.py `moe_call`,
whose address each call site passes as an attribute) on its own buffers: no Python, no GIL, no copies."""

from __future__ import annotations

import jax
import numpy as np

from host_kernels import KernelArgumentError, is_live_call

TARGET = "moe_jax_host_experts"  # host_kernels/csrc/xla_host_experts.c


def host_experts_call(call_address: int, x_td, ids_tk, weights_tk):
    """y = the routed experts of the layer whose moe_call is at `call_address`, computed on the host."""
    if not is_live_call(call_address):
        raise KernelArgumentError(f"{call_address:#x} is not the moe_call of a live fused forward")
    result = jax.ShapeDtypeStruct(x_td.shape, x_td.dtype)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(x_td, ids_tk, weights_tk, call=np.uint64(call_address))
