"""The host kernels' native library (host_kernels/csrc/, built by `pip install`; see setup.py), loaded with ctypes.

Each part needs CPU features: the AMX GEMM needs amx_tile/amx_bf16/avx512_bf16 (amx.REQUIRED_CPU_FLAGS), the
SwiGLU passes, the float32 GEMM and the fused forward avx512f/avx512bw/avx512vl (activations.NATIVE_CPU_FLAGS).
`status(flags)` says whether a part can run here and, if not, why; callers fall back to numpy. ctypes calls
release the GIL, so the worker pool runs them in parallel. MOE_JAX_HOST_KERNEL=numpy turns every part off (to
compare the two paths).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from functools import cache
from pathlib import Path

from host_kernels.native_sources import source_hash

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "native_source_hash": ([], ctypes.c_char_p),
    "amx_request_permission": ([], ctypes.c_int),
    "amx_gemm": ([_P, _I, _P, _I, _P, _I, _I, _I, _I], None),
    "bf16_pack_rows": ([_P, _I, _P, _I, _I, _P, _I, _I], None),
    "swiglu_forward": ([_P, _I, _P, _I, _P, _I, ctypes.c_int, _I, _I], None),
    "swiglu_backward": ([_P, _I, _P, _I, _P, _I, _P, _P, _P, _I, ctypes.c_int, _P, _I, _P, _I, _I, _I], None),
    "f32_gemm": ([_P, _I, _P, _I, _P, _I, _I, _I, _I], None),
    "moe_layer_new": ([ctypes.c_int, _I, _I, _I, _P, _P, _P], _P),
    "moe_layer_free": ([_P], None),
    "moe_runner_new": ([ctypes.c_int], _P),
    "moe_runner_free": ([_P], None),
    "moe_runner_threads": ([_P], ctypes.c_int),
    "moe_runner_totals": ([_P, _P], None),
    "moe_forward": ([_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, _I, _I, _I, _P, _P, _P, _I], ctypes.c_int),
    "moe_call_init": ([_P, _P, _P], None),
}


def status(flags: tuple[str, ...]) -> tuple[bool, str]:
    """(usable, why not) for a part of the library that needs these CPU flags."""
    if os.environ.get("MOE_JAX_HOST_KERNEL", "").lower() == "numpy":
        return False, "MOE_JAX_HOST_KERNEL=numpy"
    missing = [flag for flag in flags if flag not in cpu_flags()]
    if missing:
        return False, f"CPU lacks {', '.join(missing)}"
    return _loadable()


@cache
def _loadable() -> tuple[bool, str]:
    path = library_path()
    if path is None:
        return False, "native library not built (reinstall with `pip install -e .`; it needs a C compiler)"
    try:
        built_from = lib().native_source_hash().decode()
    except (OSError, AttributeError) as e:
        return False, f"cannot load {path.name}: {e}"
    try:
        expected = source_hash()
    except OSError as e:  # an install without host_kernels/csrc/: nothing to check the build against
        return False, f"cannot read the native library's sources: {e}"
    if built_from != expected:
        return False, f"{path.name} was built from other sources than host_kernels/csrc/ (reinstall: pip install -e .)"
    return True, ""


@cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_native{suffix}"
        if candidate.exists():
            return candidate
    return None


@cache
def lib():
    library = ctypes.CDLL(str(library_path()))
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


def address(array) -> int | None:
    return None if array is None else array.ctypes.data


def row_stride(array) -> int:
    """Row stride in elements of a 2-D array whose columns are contiguous (bfloat16 data travels as uint16)."""
    if array.strides[1] != array.itemsize:
        raise ValueError(f"array with strides {array.strides} does not have contiguous rows")
    return array.strides[0] // array.itemsize
