"""Which host kernels compute a store's experts, decided once: from the store's dtype, this CPU, the native
library, and the caller's choice. The engine (host_kernels/host_moe.py) takes the decision as given; nothing below
it checks the CPU again per call. A new kernel (say, int8 on VNNI) is one more case here.

`native=None` means the library default: native wherever it runs, unless MOE_JAX_HOST_KERNEL=numpy is set (the
environment only supplies the default; callers that know what they want pass `native=`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from host_kernels import activations, amx, native
from host_kernels.errors import HostKernelError
from host_kernels.expert_matmuls import (
    AMXExpertMatmuls,
    AVX2BF16ExpertMatmuls,
    AVX512BF16ExpertMatmuls,
    NumpyExpertMatmuls,
    dequantizes_to_tiles,
)
from host_kernels.fused_forward import KERNELS, best_kernel

NUMPY = NumpyExpertMatmuls.name
AMX_BF16 = AMXExpertMatmuls.name
AVX512_BF16 = AVX512BF16ExpertMatmuls.name
AVX2_BF16 = AVX2BF16ExpertMatmuls.name
AVX512, AVX2 = native.AVX512, native.AVX2  # the SwiGLU passes' variants


@dataclass(frozen=True)
class KernelChoice:
    """What runs the experts of one store.

    gemm:        the engine's tiled GEMMs (training's forward and backward): AMX_BF16, AVX512_BF16, AVX2_BF16 or
                 NUMPY
    fused:       the fused native forward (inference; hybrid's host share): a name in fused_forward.KERNELS
                 ("amx-bf16", "avx512-bf16", "avx512-f32", "avx512-int8", "avx2-f32", ...) or "" (none)
    activations: the engine's SwiGLU passes: AVX512, AVX2 or NUMPY
    why:         for each part left on numpy (or without a fused forward), the reason
    """

    gemm: str
    fused: str
    activations: str
    why: dict[str, str] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        """The fused forward reads a quantized copy of the experts (`choose_kernels(quant=...)`)."""
        return bool(self.fused) and KERNELS[self.fused].quantized

    @property
    def quant(self) -> str | None:
        """The quantized format the experts are held in (quant_formats.FORMATS), or None."""
        return KERNELS[self.fused].format.name if self.quantized else None

    def packed_bytes_per_weight(self) -> float:
        """Bytes per expert weight of the fused forward's packed copy (0: it makes none), scales aside."""
        return KERNELS[self.fused].packed_bits / 8 if self.fused else 0

    def describe(self) -> list[str]:
        """One line per part: what runs it and, where not native, why."""
        parts = (("expert GEMMs", "gemm"), ("fused expert forward", "fused"), ("SwiGLU", "activations"))
        return [
            f"{name}: {getattr(self, part) or 'none'}" + (f" ({self.why[part]})" if part in self.why else "")
            for name, part in parts
        ]


def check_choice(choice: KernelChoice, store_dtype, quant: str | None = None):
    """Refuses a choice (say, one a caller built) whose kernels cannot read a store of `store_dtype` (holding
    `quant`-quantized experts, if given)."""
    if choice.quant != quant:  # the engine's GEMMs must read the weights the fused forward reads
        held = f"{quant} experts" if quant else "float experts (quantize the store first: layer_experts.quantize_layer)"
        raise HostKernelError(f"kernel choice {choice.fused or 'without a fused forward'} cannot run {held}")
    bfloat16 = np.dtype(store_dtype) == amx.BF16
    fused_kernels = {""} | {name for name, k in KERNELS.items() if np.dtype(store_dtype) in k.store_dtypes}
    gemm_kernels = {NUMPY, AMX_BF16, AVX512_BF16, AVX2_BF16} if bfloat16 else {NUMPY}
    fits = choice.fused in fused_kernels and choice.gemm in gemm_kernels and choice.activations in (AVX512, AVX2, NUMPY)
    if not fits:
        raise HostKernelError(
            f"kernel choice {choice.gemm}/{choice.fused or 'no fused forward'}/{choice.activations} cannot run a "
            f"{np.dtype(store_dtype)} store (fused forward: one of {sorted(fused_kernels)}, GEMMs: one of "
            f"{sorted(gemm_kernels)})"
        )


def choose_kernels(store_dtype, native: bool | None = None, quant: str | None = None, off: str = "") -> KernelChoice:
    """The kernels for a store of `store_dtype` (float32 or bfloat16) on this machine: native unless `native` is
    False (None: on), `off` saying why they are not. `quant` (a quant_formats.FORMATS name): the experts are held
    quantized (a quantized store, or quantized at load), the fused forward reads them so and the engine's GEMMs
    dequantize them; refused where this machine has no kernel for it or native kernels are off: an explicit request
    is never silently dropped."""
    native, off = native is not False, off or "native kernels turned off by the caller"
    if not native:
        if quant:
            raise HostKernelError(f"{quant} experts need the native kernels, and they are off ({off})")
        return KernelChoice(NUMPY, "", NUMPY, {"gemm": off, "fused": off, "activations": off})
    why = {}
    # the engine's GEMMs: the fused forward's fastest bfloat16 kernel (AMX, else AVX512-BF16), which they share; a
    # quantized store's too where its experts dequantize straight into that kernel's tiles (expert_matmuls.py)
    bf16_store = np.dtype(store_dtype) == amx.BF16
    gemm, gemm_why = best_kernel(store_dtype) if bf16_store and (not quant or dequantizes_to_tiles(quant)) else ("", "")
    if quant:
        to = "bfloat16 for the bfloat16 kernels" if gemm else "float32 for numpy's"
        why["gemm"] = f"{quant} experts: the engine's GEMMs (expert LoRA, training's backward) dequantize each to {to}"
    elif not gemm:
        why["gemm"] = gemm_why or "float32 store: the native GEMMs multiply bfloat16"
    fused, fused_why = best_kernel(store_dtype, quant)
    if quant and not fused:
        raise HostKernelError(f"{quant} experts: no kernel on this machine ({fused_why})")
    if not fused:
        why["fused"] = f"{np.dtype(store_dtype)} store: {fused_why}"
    act_isa, act_why = activations.best_isa()
    if act_isa is None:
        why["activations"] = act_why
    return KernelChoice(gemm or NUMPY, fused, act_isa or NUMPY, why)


# the CPU features the kernels are chosen by (host_kernels/csrc/), in the order doctor lists them
KERNEL_CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
    "amx_int8",
)  # fmt: skip


def cpu_features() -> dict[str, bool]:
    """Which of KERNEL_CPU_FLAGS this CPU has."""
    flags = native.cpu_flags()
    return {flag: flag in flags for flag in KERNEL_CPU_FLAGS}


def library_status() -> tuple[bool, str]:
    """(usable, why not) for the native library itself: built, loadable, from the installed sources."""
    return native.status(())
