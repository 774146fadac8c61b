"""The sum over the run's processes of an array each holds, inside a jitted step: an expert-parallel generation
step's MoE layer output, each process's from its own experts (host_kernels/csrc/xla_process_sum.c, over the links
of moe_jax/process_links.py; a Python callback over the same links where the handler is not built). Every process
gets the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.native import ffi
from moe_jax.process_links import Links, python_sum

TARGET = "moe_jax_process_sum"
_links: Links | None = None  # this process's, while an expert-parallel generation runs (generation/lockstep.py)


def use_links(links: Links | None):
    """The links the sums go over from now on (None: none; a sum then fails)."""
    global _links
    _links = links


def process_sum(y, touched):
    """The sum over processes of `y` [rows, ...] (float32 or bfloat16, added in float32 in process order), where
    `touched` [rows] says which rows this process computed (its experts' tokens): the native handler sends only
    those (routed); the Python one every row (the same sums: the rows not sent are zeros)."""
    result = jax.ShapeDtypeStruct(y.shape, y.dtype)
    if _links is not None and _links.native:
        ffi.require(ffi.status(), "sum over processes")
        call = jax.ffi.ffi_call(TARGET, result, has_side_effect=True, vmap_method="sequential")
        return call(y, touched.astype(jnp.int32))
    return jax.pure_callback(_python_sum, result, y, vmap_method="sequential")


def _python_sum(y):
    if _links is None:
        raise RuntimeError("a sum over processes outside an expert-parallel generation (moe_jax.generation.lockstep)")
    return python_sum(_links, y)
