"""Returning XLA's compile-time memory to the OS.

Compiling a step (LLVM's passes over a model's program) allocates and frees ~0.1 GB of C heap, and glibc keeps
freed heap pages resident: a generating process then held that much more than its model for as long as it ran
(Qwen3-30B-A3B's dims cut to 2 layers, int4 experts, batch 16: 86 MB of its 170 MB above store + dense weights +
KV cache, returned by one malloc_trim after the steps compiled). JAX reports each backend compile's duration;
after a long one the heap is trimmed (a trim walks the heap: ~ms, nothing beside a compile of this size).
"""

from __future__ import annotations

import threading

from jax import monitoring

from host_kernels import trim_heap

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# compiles shorter than this leave little behind (jit of a small op: ~0.02 s)
MIN_COMPILE_S = 0.2

_registered = False
_lock = threading.Lock()


def _after_event(event: str, seconds: float, **_):
    if event == COMPILE_EVENT and seconds >= MIN_COMPILE_S:
        trim_heap()


def trim_after_compiles():
    """From now on in this process, the C heap is trimmed after each compile of MIN_COMPILE_S or more (once per
    process, however often called)."""
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_after_event)
            _registered = True
