"""host_kernels: the routed experts of MoE layers computed on the host CPU, next to their weights. No JAX.

What the rest of the project uses, importable from here:
- the expert store: `ExpertStore` (memory-mapped, kernel layout), `LayerExperts`, `QuantizedLayerExperts` and
  `quantize_layer` (experts held quantized, packed for their kernel; `quantized_expert_bytes`; `pack_int4_layer`
  for weights quantized elsewhere), `StoreWriter`,
  `file_sha256`, `release_pages` (drops a mapping's pages from RSS), `trim_heap` (returns freed C heap to the OS),
  `keep_freed_buffers` (the C heap keeps large buffers it frees, for the next use);
- the experts' function: `GLU` (SwiGLU, or GPT-OSS's clamped SwiGLU), which `HostMoE` takes with the experts'
  gate/up biases
- computing experts: `ExpertCompute`, the one face a caller computes through (forward, keeping pre-activations
  or not, backward, the native forward's address for XLA's FFI handler, and `HostTotals`: what the fused forward
  and the engine did, in one record), over `HostMoE` (the engine: tiled forward and backward; its
  `fused_forward()` is the native forward, and `is_live_call` says whether an address is one of its calls),
  `ExpertLoRA`, `default_threads`, `MAX_THREADS`; `NOT_ROUTED`, the expert id of a pair computed elsewhere;
- the kernel choice, made once per store: `choose_kernels` -> `KernelChoice` (what HostMoE runs, and why), and
  what it is made from: `cpu_features`, `library_status`; `QUANTIZED`, the quantized formats it can be asked for;
- errors: `HostKernelError` and its kinds `StoreError`, `NonFiniteError`, `KernelArgumentError`.
- for moe_jax's XLA FFI handlers, which are built into the same native library: `xla_ffi_library` (the library,
  or why the handlers are not there), `cpu_lacks`, the fused forward's kernel table `KERNELS` (each kernel's packing,
  which the dense decode handler reads too) and `best_kernel`, `BF16`; `HugePageArena`, where the packings it
  makes for those handlers go onto huge pages.
The native library's own wrappers (amx, f32_gemm, native, ...) serve the engine; nothing outside imports them.
"""

from host_kernels.activations import GLU, SWIGLU
from host_kernels.amx import BF16
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
