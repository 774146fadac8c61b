"""The environment variables moe_jax reads (its MOE_JAX_* and a cluster scheduler's), read here and nowhere else:
the execution plan, the join of a multi-process run (moe_jax/distributed.py) and the probe's cache ask this
module. They supply defaults: an argument given to `load_model` or a CLI flag wins. docs/BACKENDS.md lists them."""

from __future__ import annotations

import os
from pathlib import Path

from host_kernels import native
from moe_jax.errors import InputError

XLA_FFI = "MOE_JAX_XLA_FFI"  # "0": no XLA FFI handlers (the host kernels through callbacks)
HOST_KERNEL = "MOE_JAX_HOST_KERNEL"  # "numpy": no native host kernels
HOST_CALL = "MOE_JAX_HOST_CALL"  # how a jitted step reaches the host experts (plan.HOST_CALLS)
STREAM_SIGNAL = "MOE_JAX_STREAM_SIGNAL"  # the stream calls' signal (stream_experts.SIGNALS)
PIPELINE = "MOE_JAX_PIPELINE"  # micro-batches of the device/host pipeline
HIDE_CPU_FLAGS = native.HIDE_CPU_FLAGS  # CPU flag prefixes the kernel choice treats as absent
CACHE = "MOE_JAX_CACHE"  # where the machine probe keeps its measurements
# a multi-process run's join (moe_jax/launch.py sets them for each process it starts)
COORDINATOR, NUM_PROCESSES, PROCESS_ID = "MOE_JAX_COORDINATOR", "MOE_JAX_NUM_PROCESSES", "MOE_JAX_PROCESS_ID"


def _value(name: str) -> str | None:
    return os.environ.get(name) or None


def xla_ffi_off() -> str:
    """Why the environment turns the XLA FFI handlers off ("MOE_JAX_XLA_FFI=0"), or ""."""
    return f"{XLA_FFI}=0" if _value(XLA_FFI) == "0" else ""


def host_kernels_off() -> str:
    """Why the environment turns the native host kernels off ("MOE_JAX_HOST_KERNEL=numpy"), or ""."""
    return f"{HOST_KERNEL}=numpy" if (_value(HOST_KERNEL) or "").lower() == "numpy" else ""


def host_call() -> str | None:
    """The host call MOE_JAX_HOST_CALL asks for (unchecked: the plan says what it accepts), or None."""
    return _value(HOST_CALL)


def stream_signal() -> str | None:
    """The stream calls' signal MOE_JAX_STREAM_SIGNAL asks for (unchecked), or None."""
    return _value(STREAM_SIGNAL)


def pipeline() -> int | None:
    """The micro-batches MOE_JAX_PIPELINE asks for, or None; a value that is not a whole number is an error."""
    value = _value(PIPELINE)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{PIPELINE} must be a whole number, got {value!r}") from None


def cache_dir() -> Path:
    """Where measurements of this machine are kept: $MOE_JAX_CACHE, else ~/.cache/moe_jax."""
    return Path(_value(CACHE) or Path.home() / ".cache" / "moe_jax")


def distributed() -> dict[str, str | None]:
    """MOE_JAX_COORDINATOR, MOE_JAX_NUM_PROCESSES and MOE_JAX_PROCESS_ID as set (None where not)."""
    return {name: _value(name) for name in (COORDINATOR, NUM_PROCESSES, PROCESS_ID)}


def scheduler_tasks() -> str | None:
    """The task count a cluster scheduler set (SLURM_NTASKS, Open MPI's OMPI_COMM_WORLD_SIZE), or None: jax's
    distributed runtime joins such a run by itself."""
    return _value("SLURM_NTASKS") or _value("OMPI_COMM_WORLD_SIZE")


def hidden_cpu_flags() -> tuple[str, ...]:
    """MOE_JAX_HIDE_CPU_FLAGS's comma-separated prefixes ("amx,avx512": choose kernels as on a CPU without them)."""
    return tuple(p.strip() for p in (_value(HIDE_CPU_FLAGS) or "").split(",") if p.strip())


# handed to the host kernels' CPU check as moe_jax is imported (its api imports the plan, which imports this),
# before any plan asks for a kernel
native.hide_cpu_flags(hidden_cpu_flags())
