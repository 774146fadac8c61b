"""Errors raised by the host expert engine; each names the layer or file and the problem."""


class HostKernelError(Exception):
    """Bad input to a host kernel, or a failure inside one of its workers."""


class StoreError(HostKernelError):
    """An expert store directory is missing, truncated, corrupt or of another layout version."""


class NonFiniteError(HostKernelError):
    """An activation or gradient reaching a host kernel holds NaN or infinity (a run that diverged)."""


class KernelArgumentError(HostKernelError, ValueError):
    """An argument a Python wrapper would pass to native code is out of range, of the wrong dtype or layout, not
    writable, or needs a CPU feature this machine lacks: refused before the call, which could crash the process."""
