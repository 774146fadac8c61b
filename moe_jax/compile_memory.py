"""The C heap under XLA: compile-time memory returned to the OS, per-step buffers kept.

How it works and why: docs/INTERNALS.md, moe_jax/compile_memory.py.
"""

from __future__ import annotations

import threading

from jax import monitoring

from host_kernels import keep_freed_buffers, trim_heap

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# compiles shorter than this leave little behind (jit of a small op: ~0.02 s)
MIN_COMPILE_S = 0.2
KEEP_BUFFER_BYTES = 1 << 30  # buffers up to this size come from the heap and return to it

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


def keep_step_buffers():
    """From now on in this process, the C heap keeps the buffers it frees, up to KEEP_BUFFER_BYTES each, for the
    next step (freed memory stays resident until a trim)."""
    keep_freed_buffers(KEEP_BUFFER_BYTES)
