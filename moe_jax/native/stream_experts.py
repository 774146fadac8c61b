"""The host experts as two stream-ordered XLA FFI calls, `submit` and `sync` (host_kernels/csrc/stream_handlers.h).

How it works and why: docs/INTERNALS.md, moe_jax/native/stream_experts.py.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from host_kernels import KernelArgumentError, is_live_call, is_live_worker, xla_ffi_library
from host_kernels.stream_worker import BACKWARD, DTYPE_CODES, FORWARD, KINDS, SLOTS, cuda_status

SUBMIT, SYNC = "moe_jax_stream_submit", "moe_jax_stream_sync"
# the native library's symbol of each target on each platform (registered under the target's name)
SYMBOLS = {
    "cpu": {SUBMIT: "moe_jax_stream_submit", SYNC: "moe_jax_stream_sync"},
    "cuda": {SUBMIT: "moe_jax_cuda_stream_submit", SYNC: "moe_jax_cuda_stream_sync"},
}
# how the device side signals the worker on CUDA: stream memory operations on flags in mapped pinned memory (the
# worker polls them), or host functions on CUDA's callback thread
SIGNALS = {"memops": 0, "host-functions": 1}
REGISTERED_AS = {"cpu": "cpu", "cuda": "CUDA"}  # jax.ffi.register_ffi_target's platform names


class StreamCall(NamedTuple):
    """One call site's static settings: the worker, the layer's moe_call (a backward's: its backward layer's), the
    layer, its slot, the signal form and the kind of call (host_kernels.stream_worker.KINDS)."""

    worker: int
    call: int
    layer: int
    slot: int
    signal: str = "memops"
    kind: str = FORWARD


def platform_name() -> str:
    """jax's platform as the handlers are registered for it: "cpu" or "cuda" (else jax's own name)."""
    backend = jax.default_backend()
    return "cuda" if backend == "gpu" else backend


def status() -> tuple[bool, str]:
    """(usable, why not) of the stream calls on jax's platform: the handlers built and registered (on CUDA, the
    driver loaded too)."""
    platform = platform_name()
    if platform not in SYMBOLS:
        return False, f"no stream handlers for {platform}"
    if platform == "cuda":
        usable, reason = cuda_status()
        if not usable:
            return False, reason
    return _registered(platform)


@cache
def _registered(platform: str) -> tuple[bool, str]:
    library, reason = xla_ffi_library(tuple(SYMBOLS[platform].values()))
    if library is None:
        return False, reason
    for target, symbol in SYMBOLS[platform].items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        # CUDA: the initialize stage makes the site (allocates its pinned staging) before a graph is captured
        stages = {"initialize": capsule, "execute": capsule} if platform == "cuda" else capsule
        jax.ffi.register_ffi_target(target, stages, platform=REGISTERED_AS[platform])
    return True, ""


def _attributes(site: StreamCall) -> dict:
    if not is_live_worker(site.worker):
        raise KernelArgumentError(f"{site.worker:#x} is not a live stream worker")
    if not is_live_call(site.call):
        raise KernelArgumentError(f"{site.call:#x} is not the moe_call of a live fused forward")
    if not 0 <= site.slot < SLOTS or site.signal not in SIGNALS or site.kind not in KINDS:
        raise KernelArgumentError(f"stream call: slot {site.slot} of {SLOTS}, signal {site.signal!r}, {site.kind!r}")
    return dict(
        worker=np.uint64(site.worker),
        call=np.uint64(site.call),
        layer=np.int64(site.layer),
        slot=np.int64(site.slot),
        signal=np.int64(SIGNALS[site.signal]),
        kind=np.int64(KINDS[site.kind]),
    )


def _after(after):
    return jnp.zeros((), jnp.float32) if after is None else after


def submit(site: StreamCall, x_td, ids_tk, weights_tk, after=None, forward_ticket=None):
    """Enqueues the layer's experts for these rows, after `after` (a float32 scalar that orders this call after
    other work; default none); returns the ticket (an int32 scalar) that `sync` takes. A backward's x is dy
    (float32, as are its weights) and it names its keeping forward by that forward's `forward_ticket`."""
    call = jax.ffi.ffi_call(SUBMIT, jax.ShapeDtypeStruct((), jnp.int32), vmap_method="sequential")
    operands = (x_td, ids_tk.astype(jnp.int32), weights_tk)
    if site.kind == BACKWARD:
        operands += (forward_ticket.astype(jnp.int32),)
    return call(*operands, _after(after), **_attributes(site))


def sync(site: StreamCall, ticket, like_x, weights_tk, after=None):
    """(y shaped as `like_x`, the worker's answered ticket once y is there) of the submit that returned `ticket`,
    after `after`; a backward's (dx, dweights, the answered ticket), float32. A keeping forward's answered ticket
    names its call too, so the backward that takes it is refused if that forward has run again since."""
    shapes = (jax.ShapeDtypeStruct(like_x.shape, like_x.dtype), jax.ShapeDtypeStruct((), jnp.int32))
    if site.kind == BACKWARD:
        shapes = (shapes[0], jax.ShapeDtypeStruct(weights_tk.shape, jnp.float32), shapes[1])
    call = jax.ffi.ffi_call(SYNC, shapes, vmap_method="sequential")
    w_dtype = DTYPE_CODES[np.dtype(weights_tk.dtype)]
    attributes = dict(top_k=np.int64(weights_tk.shape[1]), w_dtype=np.int64(w_dtype), **_attributes(site))
    return call(ticket, _after(after), **attributes)


def host_experts_call(site: StreamCall, x_td, ids_tk, weights_tk):
    """y = the routed experts of the site's layer, submitted and synced at once (no work between them)."""
    return sync(site, submit(site, x_td, ids_tk, weights_tk), x_td, weights_tk)[0]
