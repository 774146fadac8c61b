"""The native libraries' sources and their hashes: shared by setup.py (which compiles each hash into its library)
and the loaders (host_kernels/native.py, moe_jax/native_call.py), which refuse a library built from other
sources. No imports beyond the standard library: setup.py loads this file before the package is installed."""

import hashlib
from pathlib import Path

SOURCES = (
    "amx_gemm.c",
    "bf16_gemm.c",
    "int4_gemm.c",
    "f32_gemm.c",
    "swiglu.c",
    "avx2_gemm.c",
    "avx2_quantized_gemm.c",
    "avx2_swiglu.c",
    "runner.c",
    "moe_forward.c",
    "source_hash.c",
)  # host_kernels._native
HEADERS = (
    "simd.h", "simd_avx2.h", "moe_forward.h", "runner.h", "amx_gemm.h", "bf16_gemm.h", "int4_gemm.h", "avx2_kernels.h"
)  # fmt: skip
CSRC = Path(__file__).parent / "csrc"
XLA_CSRC = Path(__file__).parent.parent / "moe_jax" / "csrc"
# moe_jax._xla_ffi: XLA's FFI handlers (the experts' call goes through moe_forward.h's moe_call); .c files compile
XLA_FFI_SOURCES = (
    XLA_CSRC / "xla_host_experts.c",
    XLA_CSRC / "xla_decode_attention.c",
    XLA_CSRC / "xla_argmax.c",
    XLA_CSRC / "xla_dense.c",
    CSRC / "amx_gemm.c",  # compiled into both libraries: the dense handler calls its kernels
    CSRC / "bf16_gemm.c",  # (and these, on CPUs without AMX)
    CSRC / "int4_gemm.c",
    CSRC / "avx2_gemm.c",  # (and these, on CPUs without AVX-512)
    CSRC / "avx2_quantized_gemm.c",
    XLA_CSRC / "ffi_common.h",
    CSRC / "moe_forward.h",
    CSRC / "amx_gemm.h",
    CSRC / "bf16_gemm.h",
    CSRC / "int4_gemm.h",
    CSRC / "avx2_kernels.h",
    CSRC / "simd_avx2.h",
)


def hash_files(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def source_hash() -> str:
    return hash_files(CSRC / name for name in SOURCES + HEADERS)


def xla_ffi_source_hash() -> str:
    return hash_files(XLA_FFI_SOURCES)
