"""The native library's sources and their hash: shared by setup.py (which compiles the hash into the library) and
the loader (host_kernels/native.py), which refuses a library built from other sources. No imports beyond the
standard library: setup.py loads this file before the package is installed."""

import hashlib
from pathlib import Path

SOURCES = (
    "amx_gemm.c",
    "bf16_gemm.c",
    "int4_gemm.c",
    "int8_vnni_gemm.c",
    "f32_gemm.c",
    "swiglu.c",
    "avx2_gemm.c",
    "avx2_quantized_gemm.c",
    "avx2_swiglu.c",
    "runner.c",
    "moe_forward.c",
    "moe_backward.c",
    "pack_layout.c",
    "kernel_table.c",
    "stream_worker.c",
    "source_hash.c",
)  # the kernels, and the host worker of stream-ordered expert calls
HEADERS = (
    "simd.h", "simd_avx2.h", "moe_forward.h", "moe_call.h", "runner.h", "amx_gemm.h", "bf16_gemm.h", "f32_gemm.h",
    "int4_gemm.h", "int8_vnni_gemm.h", "avx2_kernels.h", "stream_worker.h", "kernel_table.h",
)  # fmt: skip
CSRC = Path(__file__).parent / "csrc"
# XLA's FFI handlers, built into the same library where jaxlib's C API header is found (setup.py); they call the
# kernels above directly, and the experts' handler goes through moe_forward.h's moe_call
XLA_FFI_SOURCES = (
    "xla_host_experts.c", "xla_cache_attention.c", "xla_argmax.c", "xla_sample.c", "xla_dense.c",
    "xla_stream_experts.c", "xla_process_sum.c",
)  # fmt: skip
XLA_FFI_HEADERS = (
    "ffi_common.h", "xla_argmax.h", "cache_attention_block.h", "cache_attention_blocks.h", "stream_handlers.h",
)  # fmt: skip
# the stream-ordered expert calls' CUDA handlers, built with the FFI handlers where CUDA's cuda.h is found too (they
# open the driver at run time: the same build runs where there is no GPU)
CUDA_SOURCES = ("xla_cuda_host_experts.c",)


def hash_files(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


ALL_SOURCES = SOURCES + HEADERS + XLA_FFI_SOURCES + XLA_FFI_HEADERS + CUDA_SOURCES


def source_hash() -> str:
    """One hash over every native source, handlers included (whether or not this build compiled them)."""
    return hash_files(CSRC / name for name in ALL_SOURCES)
