"""host_kernels: the routed experts of MoE layers computed on the host CPU, next to their weights. No JAX. What the
rest of the project uses is importable from here (`__all__`): the expert store, the engine and its one face
(`ExpertCompute`), the kernel choice, the errors, and what moe_jax's XLA FFI handlers need from the native library.

How it works and why: docs/INTERNALS.md, host_kernels/__init__.py.
"""

from host_kernels.activations import GLU, SWIGLU
from host_kernels.amx import BF16, aligned_empty
from host_kernels.choice import KernelChoice, choose_kernels, cpu_features, library_status
from host_kernels.compute import ExpertCompute, HostTotals
from host_kernels.errors import HostKernelError, KernelArgumentError, NonFiniteError, StoreError
from host_kernels.fused_forward import KERNELS, QUANTIZED, best_kernel, is_live_call
from host_kernels.host_moe import HostMoE
from host_kernels.huge_pages import HugePageArena
from host_kernels.layer_experts import (
    LayerExperts,
    QuantizedLayerExperts,
    pack_int4_layer,
    pack_mxfp4_layer,
    quantize_layer,
    quantized_expert_bytes,
)
from host_kernels.lora import ExpertLoRA
from host_kernels.native import cpu_lacks, keep_freed_buffers, trim_heap, xla_ffi_library
from host_kernels.pool import MAX_THREADS, default_threads
from host_kernels.quant import QuantizedMXFP4
from host_kernels.schedule import NOT_ROUTED
from host_kernels.store import ExpertStore, StoreWriter, file_sha256, release_pages
from host_kernels.stream_worker import StreamWorker, is_live_worker

__all__ = [
    "GLU",
    "SWIGLU",
    "QuantizedMXFP4",
    "BF16",
    "KERNELS",
    "MAX_THREADS",
    "NOT_ROUTED",
    "QUANTIZED",
    "ExpertCompute",
    "ExpertLoRA",
    "ExpertStore",
    "HostKernelError",
    "HostMoE",
    "HostTotals",
    "HugePageArena",
    "aligned_empty",
    "KernelChoice",
    "KernelArgumentError",
    "LayerExperts",
    "QuantizedLayerExperts",
    "NonFiniteError",
    "StoreError",
    "StoreWriter",
    "StreamWorker",
    "best_kernel",
    "choose_kernels",
    "cpu_lacks",
    "cpu_features",
    "default_threads",
    "file_sha256",
    "is_live_call",
    "is_live_worker",
    "keep_freed_buffers",
    "library_status",
    "pack_int4_layer",
    "pack_mxfp4_layer",
    "quantize_layer",
    "quantized_expert_bytes",
    "release_pages",
    "trim_heap",
    "xla_ffi_library",
]
