"""The host kernels' native library (host_kernels/csrc/, built by `pip install`; see setup.py), loaded with ctypes.

Each part needs CPU features: the AMX GEMM needs amx_tile/amx_bf16/avx512_bf16 (amx.REQUIRED_CPU_FLAGS), the
SwiGLU passes, the float32 GEMM and the fused forward avx512f/avx512bw/avx512vl (activations.NATIVE_CPU_FLAGS); on
CPUs without AVX-512, their AVX2 variants (`<name>_avx2`, AVX2_CPU_FLAGS) read the same packed weights.
`status(flags)` says whether a part can run here and, if not, why (host_kernels/choice.py decides from it, once,
which parts run and which fall back to numpy; `pick_isa` picks a kernel's variant). ctypes calls release the GIL,
so the worker pool runs them in parallel.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from functools import cache
from pathlib import Path

import numpy as np

from host_kernels.errors import KernelArgumentError
from host_kernels.native_sources import source_hash

AVX512, AVX2 = "avx512", "avx2"  # the instruction sets the kernels have variants for, fastest first
AVX2_CPU_FLAGS = ("avx2", "fma")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_GEMM = ([_P, _I, _P, _I, _P, _I, _I, _I, _I], None)
_SWIGLU_FORWARD = ([_P, _I, _P, _I, _P, _I, ctypes.c_int, _I, _I], None)
_SWIGLU_BACKWARD = ([_P, _I, _P, _I, _P, _I, _P, _P, _P, _I, ctypes.c_int, _P, _I, _P, _I, _I, _I], None)
_F = ctypes.c_float
_CLAMPED_SWIGLU_FORWARD = (_SWIGLU_FORWARD[0] + [_F, _F], None)
_CLAMPED_SWIGLU_BACKWARD = (_SWIGLU_BACKWARD[0] + [_F, _F], None)
_INT4_GEMM = ([_P, _I, _P, _I, _P, _I, _I, _I, _I, _I], ctypes.c_int)
SIGNATURES = {
    "native_source_hash": ([], ctypes.c_char_p),
    "amx_request_permission": ([], ctypes.c_int),
    "amx_gemm": ([_P, _I, _P, _I, _P, _I, _I, _I, _I], None),
    **{f"bf16_pack_rows{suffix}": ([_P, _I, _P, _I, _I, _P, _I, _I], None) for suffix in ("", "_avx2")},
    **{f"swiglu_forward{suffix}": _SWIGLU_FORWARD for suffix in ("", "_avx2")},
    **{f"swiglu_backward{suffix}": _SWIGLU_BACKWARD for suffix in ("", "_avx2")},
    **{f"clamped_swiglu_forward{suffix}": _CLAMPED_SWIGLU_FORWARD for suffix in ("", "_avx2")},
    **{f"clamped_swiglu_backward{suffix}": _CLAMPED_SWIGLU_BACKWARD for suffix in ("", "_avx2")},
    **{f"{name}{suffix}": _GEMM for name in ("f32_gemm", "bf16_gemm", "int8_gemm") for suffix in ("", "_avx2")},
    "int8_gemm_amx": _GEMM,
    "pack_bf16_tiles": ([_P, _I, _I, _I, _I, _P], None),
    "int8_gemm_avx2": (_GEMM[0], ctypes.c_int),  # quantizes its rows first: non-zero where memory ran out
    **{f"int4_gemm{suffix}": _INT4_GEMM for suffix in ("", "_avx2")},
    **{f"mxfp4_gemm{suffix}": (_GEMM[0], ctypes.c_int) for suffix in ("", "_avx2")},
    **{f"int4_unpack{suffix}": ([_P, _I, _I, _I, _I, _P, _I], None) for suffix in ("", "_avx2")},
    "int4_unpack_bf16_tiles": ([_P, _I, _I, _I, _I, _I, ctypes.c_int, _P, _P], None),
    "moe_kernel_code": ([ctypes.c_char_p], ctypes.c_int),
    "moe_kernel_describe": ([ctypes.c_int, _P], ctypes.c_char_p),
    "moe_kernel_count": ([], ctypes.c_int),
    "moe_layer_new": ([ctypes.c_int, _I, _I, _I, _P, _P, _P, _I], _P),
    "moe_layer_set_glu": ([_P, ctypes.c_int, _F, _F, _P], ctypes.c_int),
    "moe_layer_free": ([_P], None),
    "moe_runner_new": ([ctypes.c_int], _P),
    "moe_runner_free": ([_P], None),
    "moe_runner_threads": ([_P], ctypes.c_int),
    "moe_runner_totals": ([_P, _P], None),
    "moe_forward": ([_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, _I, _I, _I, _P, _P, _P, _I], ctypes.c_int),
    "moe_forward_keeping": ([_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, _I, _I, _I, _P, _P, _P, _I], ctypes.c_int),
    "moe_call_init": ([_P, _P, _P], None),
    "moe_backward": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _I], ctypes.c_int),
    # the host worker of stream-ordered expert calls (csrc/stream_worker.h; host_kernels/stream_worker.py)
    "moe_stream_worker_new": ([_P, _I, _I], _P),
    "moe_stream_worker_stop": ([_P], None),
    "moe_stream_worker_free": ([_P], None),
    "moe_stream_worker_stopped": ([_P], ctypes.c_int),
    "moe_stream_site": ([_P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int, _P, _I], _I),
    "moe_stream_site_staging": ([_P, _I, _P], ctypes.c_int),
    "moe_stream_answer": ([_P, _I, _P], ctypes.c_int),
    "moe_stream_post": ([_P, _I], None),
    "moe_stream_wait": ([_P, _I, _I], ctypes.c_int),
    "moe_stream_ring": ([_P], None),
    "moe_stream_take_error": ([_P, _P, _P, _I], ctypes.c_int),
    "moe_stream_peek_error": ([_P, _P, _P, _I], ctypes.c_int),
    "moe_stream_counters": ([_P, _P], None),
}
# built only where CUDA's cuda.h was found (setup.py): looked up by `cuda_function`
CUDA_SIGNATURES = {
    "moe_cuda_stream_status": ([], ctypes.c_char_p),
    "moe_cuda_stream_memops": ([ctypes.c_int], ctypes.c_int),
    "moe_cuda_pinned_memory": ([], _P),
}


def status(flags: tuple[str, ...]) -> tuple[bool, str]:
    """(usable, why not) for a part of the library that needs these CPU flags."""
    lacking = cpu_lacks(flags)
    return (False, lacking) if lacking else _loadable()


def symbol(name: str, isa: str) -> str:
    """The library's symbol for kernel `name`'s `isa` variant (the AVX-512 ones carry no suffix)."""
    return name if isa == AVX512 else f"{name}_{isa}"


def variant_statuses(cpu_flags: dict[str, tuple[str, ...]]) -> dict[str, tuple[bool, str]]:
    """isa -> status() for a kernel whose variants need these CPU flags (isa -> flags, fastest first)."""
    return {isa: status(flags) for isa, flags in cpu_flags.items()}


def best_isa(statuses: dict[str, tuple[bool, str]]) -> tuple[str | None, str]:
    """(the first of `statuses` (isa -> status(), fastest first) this machine runs, "") or (None, why none)."""
    for name, (usable, _) in statuses.items():
        if usable:
            return name, ""
    return None, "; ".join(f"{name}: {why}" for name, (_, why) in statuses.items())


def pick_isa(statuses: dict[str, tuple[bool, str]], isa: str | None, what: str) -> str:
    """The instruction set `what` runs on: `isa` when given, else `best_isa(statuses)`; KernelArgumentError where
    this machine runs none (or not the one asked for)."""
    if isa is not None:
        if isa not in statuses:
            raise KernelArgumentError(f"{what}: no {isa} variant (variants: {', '.join(statuses)})")
        require(statuses[isa], f"{what} ({isa})")
        return isa
    best, why = best_isa(statuses)
    if best is None:
        raise KernelArgumentError(f"{what} unavailable: {why}")
    return best


@cache
def cpu_lacks(flags: tuple[str, ...]) -> str:
    """ "CPU lacks ..." naming the flags this CPU does not have, or "" when it has them all."""
    missing = [flag for flag in flags if flag not in cpu_flags()]
    return f"CPU lacks {', '.join(missing)}" if missing else ""


@cache
def _loadable() -> tuple[bool, str]:
    path = library_path()
    if path is None:
        return False, "native library not built (reinstall with `pip install -e .`; it needs a C compiler)"
    try:
        library = lib()
    except OSError as e:
        return False, f"cannot load {path.name}: {e}"
    reason = built_from_sources(library, "native_source_hash", source_hash, path)
    return not reason, reason


def xla_ffi_library(symbols: tuple[str, ...]):
    """(the native library, "") when XLA's FFI handlers `symbols` are built into it, else (None, why not)."""
    usable, reason = _loadable()
    if not usable:
        return None, reason
    library = lib()
    if not all(hasattr(library, symbol) for symbol in symbols):
        return None, (
            "host_kernels' native library was built without the XLA FFI handlers (jaxlib's headers were not found; "
            "reinstall with `pip install -e .` where jaxlib is installed)"
        )
    return library, ""


def built_from_sources(library, hash_symbol: str, source_hash_now, path: Path) -> str:
    """Why `library` must not be called ("" if it may): it carries, as `hash_symbol()`, the hash of the sources it
    was built from; `source_hash_now()` hashes the sources as they are (native_sources.py)."""
    try:
        function = getattr(library, hash_symbol)
        function.restype = ctypes.c_char_p
        built_from = function().decode()
    except AttributeError as e:
        return f"cannot load {path.name}: {e}"
    try:
        expected = source_hash_now()
    except OSError as e:  # an install without the sources: nothing to check the build against
        return f"cannot read the sources of {path.name}: {e}"
    if built_from != expected:
        return f"{path.name} was built from other sources than those installed (reinstall: pip install -e .)"
    return ""


HIDE_CPU_FLAGS = "MOE_JAX_HIDE_CPU_FLAGS"  # moe_jax's variable for `hide_cpu_flags` (moe_jax/planning/environment.py)
_hidden_prefixes: tuple[str, ...] = ()


def hide_cpu_flags(prefixes: tuple[str, ...]):
    """Treats the CPU flags starting with any of `prefixes` as absent from now on ("amx", "avx512", "avx_vnni": run
    the AVX2 kernels as on a CPU without AVX-512, e.g. to compare against such a CPU's other engines here). Call it
    before anything asks for a kernel's status: the answers are kept."""
    global _hidden_prefixes
    _hidden_prefixes = tuple(prefixes)
    cpu_lacks.cache_clear()


def cpu_flags() -> frozenset[str]:
    """This CPU's flags, less those `hide_cpu_flags` hid."""
    hidden = _hidden_prefixes
    return frozenset(flag for flag in _proc_cpu_flags() if not flag.startswith(hidden)) if hidden else _proc_cpu_flags()


@cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def library_path() -> Path | None:
    return extension_path(Path(__file__).parent, "_native")


def extension_path(directory: Path, name: str) -> Path | None:
    """The built extension module `name` in `directory` (whatever this Python's suffix), or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"{name}{suffix}"
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


def cuda_function(name: str):
    """The library's CUDA-side function `name` (CUDA_SIGNATURES), or None where the build has no CUDA handlers."""
    library = lib()
    if not hasattr(library, name):
        return None
    function = getattr(library, name)
    function.argtypes, function.restype = CUDA_SIGNATURES[name]
    return function


@cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap():
    """Returns the C heap's free memory to the OS (glibc's malloc_trim; nothing elsewhere). Packing a layer frees
    as much temporary memory as it keeps, and glibc keeps freed heap pages resident: without this a bfloat16
    model's process held ~0.8 GB more than its weights (Qwen3-30B-A3B dims, 2 layers)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_buffers(up_to_bytes: int) -> bool:
    """Has glibc serve allocations of up to `up_to_bytes` from its heap and keep freed heap pages, instead of mapping
    each large buffer anew and unmapping it when freed (so the kernel zeroes its pages again at every first touch).
    Freed memory then stays resident until `trim_heap`. Returns whether the C library took both settings."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    int_max = 2**31 - 1  # mallopt takes a C int
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, min(up_to_bytes, int_max))
    return bool(mmap_set) & bool(libc.mallopt(M_TRIM_THRESHOLD, min(2 * up_to_bytes, int_max)))


def require(usable: tuple[bool, str], what: str):
    """Refuses a native call this machine cannot make (a SIGILL otherwise): `usable` is a status() pair."""
    if not usable[0]:
        raise KernelArgumentError(f"{what} unavailable: {usable[1]}")


def check_writable(what: str, array):
    if not array.flags.writeable:
        raise KernelArgumentError(f"{what} is read-only; native code writes into it")


def check_extent(what: str, array, rows: int, row_elements: int | None = None):
    """`rows` rows of `array` from its first (at its row stride), each `row_elements` long (default: the view's
    width), lie inside the memory of the array it views: a kernel may read past a view's shape (a tile reads 16
    rows, a row its padding) but never past the buffer underneath."""
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    low, high = np.lib.array_utils.byte_bounds(base)
    start = array.ctypes.data
    width = array.shape[1] if row_elements is None else row_elements
    end = start + (rows - 1) * array.strides[0] + width * array.itemsize if rows else start
    if start < low or end > high:
        raise KernelArgumentError(f"{what}: {rows} rows from its start run past the buffer it is a view of")


def check_bf16_rows(a, k: int, kp: int):
    """bfloat16 rows (uint16) that a kernel reads kp columns of: 2-D, unit column stride, row stride at least kp,
    at least k columns in the view, every row's kp elements inside the buffer underneath."""
    if a.dtype != np.uint16 or a.ndim != 2 or a.strides[1] != 2 or a.strides[0] < 2 * kp or a.shape[1] < k:
        raise KernelArgumentError(
            f"rows are {a.dtype} {a.shape} strides {a.strides}, expected uint16 rows of at least {kp} (w.kp)"
        )
    check_extent("rows", a, a.shape[0], row_elements=kp)


def check_gemm_output(out, m: int, n0: int, n1: int, n: int, block: int):
    """A GEMM's column range [n0, n1) of an n-column weight (n0 on a `block` boundary) and its float32 [m, n1 - n0]
    output (rows may be strided, columns not, writable); KernelArgumentError naming what does not fit."""
    if n0 % block or not 0 <= n0 < n1 <= n:
        raise KernelArgumentError(
            f"column range [{n0}, {n1}) of a {n}-column weight must start at a multiple of {block}"
        )
    if out.dtype != "float32" or out.shape != (m, n1 - n0) or out.strides[1] != 4:
        raise KernelArgumentError(
            f"output is {out.dtype} {out.shape} strides {out.strides}, expected float32 [{m}, {n1 - n0}]"
        )
    check_writable("GEMM output", out)


def check_packed(what: str, data, dtype, shape: tuple[int, ...]):
    """A packed weight's data: `dtype`, C-contiguous, of exactly the shape its recorded k and n imply."""
    if data.dtype != dtype or data.shape != shape or not data.flags.c_contiguous:
        raise KernelArgumentError(
            f"{what}: data is {data.dtype} {data.shape}, its k and n need C-contiguous {np.dtype(dtype)} {shape}"
        )


def address(array) -> int | None:
    return None if array is None else array.ctypes.data


def row_stride(array) -> int:
    """Row stride in elements of a 2-D array whose columns are contiguous (bfloat16 data travels as uint16)."""
    if array.ndim != 2 or array.strides[1] != array.itemsize or array.strides[0] < 0:
        raise KernelArgumentError(f"array with strides {array.strides} does not have contiguous rows")
    return array.strides[0] // array.itemsize
