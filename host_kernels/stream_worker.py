"""The host worker of stream-ordered expert calls (csrc/stream_worker.h has the protocol).

How it works and why: docs/INTERNALS.md, host_kernels/stream_worker.py.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from host_kernels import native
from host_kernels.errors import HostKernelError, KernelArgumentError
from host_kernels.fused_forward import DTYPE_CODES

SLOTS = 8  # csrc/stream_worker.h STREAM_SLOTS: calls in flight at once at most
# a site's kind of call (STREAM_FORWARD, ...): a forward; a training forward that keeps its pre-activations in
# its site; a backward that reads them (float32 dy and routing weights in, dx and dweights out)
FORWARD, FORWARD_KEEPING, BACKWARD = "forward", "forward-keeping", "backward"
KINDS = {FORWARD: 0, FORWARD_KEEPING: 1, BACKWARD: 2}
# what moe_stream_wait returns besides 0 (answered)
FAILED, STOPPED, TIMED_OUT, UNKNOWN_SITE = 1, 2, -1, -2
COUNTER_NAMES = ("calls", "failed", "busy_ns", "sleeps", "sites", "staging_bytes")
MEMORY_KINDS = ("host", "cuda")


def cuda_status() -> tuple[bool, str]:
    """(usable, why not) of the CUDA side: the handlers built in and the driver loaded."""
    usable, reason = native.status(())
    if not usable:
        return False, reason
    status = native.cuda_function("moe_cuda_stream_status")
    if status is None:
        return False, "host_kernels' native library was built without the CUDA stream handlers (no cuda.h found)"
    why = status().decode()
    return not why, why


def cuda_memops(ordinal: int = 0) -> bool:
    """Whether GPU `ordinal` runs 64-bit stream memory operations (the go/done flags as stream writes and waits)."""
    memops = native.cuda_function("moe_cuda_stream_memops")
    return bool(memops and cuda_status()[0] and memops(ordinal))


@dataclass(frozen=True)
class StreamError:
    layer: int  # -1: a go that named no site of its slot
    message: str


class StreamWorker:
    """One host worker thread and its staging memory. `spin_us`: how long it spins after a call before it sleeps;
    `poll_us`: how often it looks at the flags while asleep (a stream memory write cannot wake it)."""

    def __init__(self, memory: str = "host", spin_us: float = 200.0, poll_us: float = 50.0):
        if memory not in MEMORY_KINDS:
            raise KernelArgumentError(f"staging memory must be one of {', '.join(MEMORY_KINDS)}, got {memory!r}")
        usable, reason = native.status(())
        if not usable:
            raise HostKernelError(f"stream worker unavailable: {reason}")
        allocator = None
        if memory == "cuda":
            usable, reason = cuda_status()
            if not usable:
                raise HostKernelError(f"stream worker on CUDA pinned memory unavailable: {reason}")
            allocator = native.cuda_function("moe_cuda_pinned_memory")()
        self.memory = memory
        self._lib = native.lib()
        self._pointer = self._lib.moe_stream_worker_new(allocator, int(spin_us * 1e3), int(poll_us * 1e3))
        if not self._pointer:
            raise HostKernelError(f"cannot start the stream worker (spin {spin_us} us, poll {poll_us} us)")
        _LIVE_WORKERS.add(self._pointer)
        self._finalizer = weakref.finalize(self, _free, self._lib, self._pointer)

    @property
    def address(self) -> int:
        """The native worker's address (the handlers' `worker` attribute); valid while this object lives."""
        return self._pointer

    def site(
        self,
        call_address: int,
        layer: int,
        slot: int,
        tokens: int,
        hidden: int,
        top_k: int,
        x_dtype,
        w_dtype,
        kind: str = FORWARD,
    ) -> int:
        """The id of the call site (made on first use) of the moe_call at `call_address` (a backward's: the
        backward layer's) for these shapes and dtypes (float32 or bfloat16), on `slot`, of `kind`."""
        codes = [DTYPE_CODES.get(np.dtype(d)) for d in (x_dtype, w_dtype)]
        if None in codes:
            raise KernelArgumentError(f"layer {layer}: activations and routing weights are float32 or bfloat16")
        if kind not in KINDS:
            raise KernelArgumentError(f"layer {layer}: a call is one of {', '.join(KINDS)}, not {kind!r}")
        message = ctypes.create_string_buffer(256)
        site = self._lib.moe_stream_site(
            self._pointer, call_address, layer, slot, KINDS[kind], tokens, hidden, top_k, *codes, message, len(message)
        )
        if site < 0:
            raise KernelArgumentError(f"stream site: {message.value.decode()}")
        return site

    def staging(self, site: int, tokens: int, hidden: int, top_k: int, x_dtype, w_dtype):
        """numpy views of the site's staging buffers (x, ids, weights, y), shaped as the site was made; a
        backward's also its forward's ticket ([1, 1] int32) and dweights ([tokens, top_k] float32)."""
        buffers = (ctypes.c_void_p * 6)()
        if self._lib.moe_stream_site_staging(self._pointer, site, buffers):
            raise KernelArgumentError(f"no stream site {site}")
        x, routing = (tokens, hidden, x_dtype), (tokens, top_k)
        shapes = (x, (*routing, np.int32), (*routing, w_dtype), x, (1, 1, np.int32), (*routing, np.float32))
        count = 6 if buffers[4] else 4
        return tuple(
            _view(address, (rows, cols), dtype)
            for address, (rows, cols, dtype) in zip(buffers[:count], shapes[:count], strict=True)
        )

    def post(self, site: int):
        """The go of `site` (its staging filled)."""
        self._lib.moe_stream_post(self._pointer, site)

    def wait(self, site: int, timeout_s: float | None = None) -> int:
        """Waits for the worker's answer to `site` (at most `timeout_s`); 0, FAILED, STOPPED, TIMED_OUT or
        UNKNOWN_SITE."""
        timeout = -1 if timeout_s is None else int(timeout_s * 1e9)
        return self._lib.moe_stream_wait(self._pointer, site, timeout)

    def answer(self, site: int) -> int:
        """The ticket the worker answered `site`'s last call with (a keeping forward's names the call: its backward
        takes this one; -1 for a failed call)."""
        ticket = ctypes.c_int32()
        if self._lib.moe_stream_answer(self._pointer, site, ctypes.byref(ticket)):
            raise KernelArgumentError(f"no stream site {site}")
        return ticket.value

    def ring(self):
        """Wakes the worker if it sleeps (a call is coming)."""
        self._lib.moe_stream_ring(self._pointer)

    def take_error(self) -> StreamError | None:
        """The first failed call since the last take (its layer and message), or None."""
        layer, message = ctypes.c_int64(), ctypes.create_string_buffer(256)
        if not self._lib.moe_stream_take_error(self._pointer, ctypes.byref(layer), message, len(message)):
            return None
        return StreamError(layer.value, message.value.decode())

    def counters(self) -> dict[str, int]:
        values = np.zeros(len(COUNTER_NAMES), np.uint64)
        self._lib.moe_stream_counters(self._pointer, values.ctypes.data)
        return {name: int(v) for name, v in zip(COUNTER_NAMES, values, strict=True)}

    @property
    def stopped(self) -> bool:
        return bool(self._lib.moe_stream_worker_stopped(self._pointer))

    def stop(self):
        """Stops the thread: the call it runs finishes, every other pending go is answered STOPPED, and so is any
        later post. The memory stays until this object is dropped."""
        self._lib.moe_stream_worker_stop(self._pointer)


def _view(address: int, shape: tuple[int, int], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = shape[0] * shape[1]
    if not count:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


_LIVE_WORKERS: set[int] = set()


def is_live_worker(address: int) -> bool:
    """Whether `address` is a StreamWorker still alive (anything else would crash the handlers)."""
    return address in _LIVE_WORKERS


def _free(lib, pointer):
    _LIVE_WORKERS.discard(pointer)
    lib.moe_stream_worker_free(pointer)
