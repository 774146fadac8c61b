"""The XLA FFI handlers' registration: one per process, for the CPU platform.

How it works and why: docs/INTERNALS.md, moe_jax/native/ffi.py.
"""

from __future__ import annotations

from functools import cache

import jax

from host_kernels import cpu_lacks, xla_ffi_library

# the custom-call targets, each registered under its C symbol's name
HANDLERS = (
    "moe_jax_host_experts", "moe_jax_cache_attention", "moe_jax_argmax", "moe_jax_sample", "moe_jax_dense",
    "moe_jax_process_sum",
)  # fmt: skip


def status() -> tuple[bool, str]:
    """(usable, why not): the steps run on XLA:CPU and the handlers are built from the current sources and
    registered. Whether they are used is the execution plan's decision (moe_jax/planning/plan.py)."""
    if jax.default_backend() != "cpu":  # the handlers are registered for XLA:CPU; an accelerator's step calls back
        return False, f"the model runs on {jax.default_backend()}; the handlers serve XLA:CPU steps"
    return _registered()


@cache
def _registered() -> tuple[bool, str]:
    library, reason = xla_ffi_library(HANDLERS)
    if library is None:
        return False, reason
    for target in HANDLERS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    return True, ""


def kernel_status(cpu_flags) -> tuple[bool, str]:
    """(usable, why not) for a handler whose kernel needs `cpu_flags`: the handlers' status, then the CPU's."""
    usable, reason = status()
    if not usable:
        return usable, reason
    lacking = cpu_lacks(cpu_flags)
    return not lacking, lacking


def variants_status(cpu_flags: dict, isa: str | None = None) -> tuple[bool, str]:
    """(usable, why not) for a handler with instruction-set variants (`cpu_flags`: each variant's flags, fastest
    first): on `isa`, or on any of them."""
    if isa is not None:
        return kernel_status(cpu_flags[isa])
    statuses = {name: kernel_status(flags) for name, flags in cpu_flags.items()}
    if any(usable for usable, _ in statuses.values()):
        return True, ""
    return False, "; ".join(f"{name}: {why}" for name, (_, why) in statuses.items())


def fastest(cpu_flags: dict, isa: str | None = None) -> str:
    """`isa`, or by default the fastest of a handler's variants this CPU runs (the first in `cpu_flags` whose
    flags it has; the first of all where none: the call's `require` then says why)."""
    if isa is not None:
        return isa
    return next((name for name, flags in cpu_flags.items() if kernel_status(flags)[0]), next(iter(cpu_flags)))


def require(usable_reason: tuple[bool, str], what: str):
    """Refuses a call into a handler the status says is unusable (the status call also registers the handlers)."""
    usable, reason = usable_reason
    if not usable:
        raise RuntimeError(f"native {what} unavailable: {reason}")
