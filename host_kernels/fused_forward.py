"""The fused forward of a layer's routed experts in one native call (host_kernels/csrc/moe_forward.c).

How it works and why: docs/INTERNALS.md, host_kernels/fused_forward.py.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from functools import partial

import numpy as np
from tqdm import tqdm

from host_kernels import amx, bf16_gemm, f32_gemm, int4_gemm, int8_gemm, kernel_table, mxfp4_gemm, native
from host_kernels.activations import GLU, SWIGLU
from host_kernels.errors import HostKernelError, KernelArgumentError
from host_kernels.expert_matmuls import AMXExpertMatmuls, AVX2BF16ExpertMatmuls, AVX512BF16ExpertMatmuls
from host_kernels.huge_pages import HugePageArena
from host_kernels.layer_experts import LayerExperts, QuantizedLayerExperts, gate_up_blocks
from host_kernels.pool import check_thread_count
from host_kernels.quant_formats import FORMATS, QuantFormat
from host_kernels.schedule import NOT_ROUTED, check_expert_ids
from host_kernels.store import ExpertStore

DTYPE_CODES = {np.dtype(np.float32): 0, amx.BF16: 1}  # MOE_FLOAT32, MOE_BFLOAT16
# the kernels' names: the bfloat16 ones are the engine's GEMMs of the same name (expert_matmuls.py)
AVX512_F32, AVX2_F32 = "avx512-f32", "avx2-f32"
AMX_BF16, AVX512_BF16, AVX2_BF16 = AMXExpertMatmuls.name, AVX512BF16ExpertMatmuls.name, AVX2BF16ExpertMatmuls.name
F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class FusedKernel:
    """One GEMM kernel of the fused forward: what it computes from and how its weights are packed."""

    table_name: str  # its row of the native kernel table (kernel_table.h): int4's serves every group
    store_dtypes: tuple  # the store dtypes it computes from
    status: Callable[[], tuple[bool, str]]  # whether this machine runs it, and why not
    packed: type  # the packed weight type it reads
    block: int  # columns per block of that layout (w13's up half starts on one)
    pack_dtype: np.dtype  # the dtype a [k, n] weight is handed to `pack` in
    pack: Callable  # [k, n] weight -> packed
    packed_bits: int  # bits per weight in the packed copy (scales aside)
    # the quantized format it reads (quant_formats.FORMATS): such a kernel runs only when asked for (`quant`),
    # never picked by speed
    format: QuantFormat | None = None

    @property
    def code(self) -> int:
        """The native kernel table's code (looked up in the library by name)."""
        return kernel_table.code(self.table_name)

    @property
    def quantized(self) -> bool:
        return self.format is not None

    @property
    def group(self) -> int:
        """int4: k-rows per scale (moe_layer_new's `group`); 0 otherwise."""
        return self.format.group if self.format else 0


_QUANTIZED_MODULES = {"int8": int8_gemm, "int4": int4_gemm, "mxfp4": mxfp4_gemm}


def _quantized_kernel(quant: QuantFormat, isa: str) -> FusedKernel:
    """int8 on AMX, AVX512-BF16 or AVX2; int4 (any group) and mxfp4 on AVX512-VNNI or AVX2."""
    kind = quant.name.split("-")[0]
    packed, pack = quant.packed_type, quant.pack
    status = partial(_QUANTIZED_MODULES[kind].status, isa)
    table_name = f"{isa}-{kind}"
    return FusedKernel(table_name, (F32, amx.BF16), status, packed, amx.N_BLOCK, F32, pack, quant.bits, format=quant)


# load_model(quant=...) -> the kernels that read such weights, fastest first ("int4": llama.cpp Q4_0's group of
# 32 k-rows), by instruction set; int8 also on AMX tiles (prefill-sized experts)
QUANTIZED_ISAS = {name: ((int8_gemm.AMX,) if name == "int8" else ()) + (native.AVX512, native.AVX2) for name in FORMATS}
QUANTIZED = {name: tuple(f"{isa}-{name}" for isa in isas) for name, isas in QUANTIZED_ISAS.items()}
_F32_PACKING = (f32_gemm.PackedF32, f32_gemm.N_BLOCK, F32, f32_gemm.pack, 32)
_BF16_PACKING = (amx.PackedWeight, amx.N_BLOCK, amx.BF16, amx.pack_layout, 16)
KERNELS = {  # fastest first for each store dtype
    AVX512_F32: FusedKernel(AVX512_F32, (F32,), f32_gemm.status, *_F32_PACKING),
    AMX_BF16: FusedKernel(AMX_BF16, (amx.BF16,), amx.status, *_BF16_PACKING),
    AVX512_BF16: FusedKernel(AVX512_BF16, (amx.BF16,), bf16_gemm.status, *_BF16_PACKING),
    AVX2_F32: FusedKernel(AVX2_F32, (F32,), partial(f32_gemm.status, native.AVX2), *_F32_PACKING),
    AVX2_BF16: FusedKernel(AVX2_BF16, (amx.BF16,), partial(bf16_gemm.status, native.AVX2), *_BF16_PACKING),
    **{
        kernel: _quantized_kernel(quant, isa)
        for name, quant in FORMATS.items()
        for kernel, isa in zip(QUANTIZED[name], QUANTIZED_ISAS[name], strict=True)
    },
}
TOTAL_NAMES = (
    "calls", "seconds", "xla_call_seconds", "busy_seconds", "tokens", "pairs", "flops", "weight_bytes", "bytes_in",
    "bytes_out",
)  # fmt: skip


class MoeCall(ctypes.Structure):
    _fields_ = [("forward", ctypes.c_void_p), ("runner", ctypes.c_void_p), ("layer", ctypes.c_void_p)]


@dataclass
class FusedTotals:
    """What the native forward did since the previous `take_totals()`."""

    calls: int = 0
    seconds: float = 0.0  # wall time of the calls
    xla_call_seconds: float = 0.0  # of that, the calls XLA made through its FFI handler (its step waited on them)
    busy_seconds: float = 0.0  # summed over the runner's threads
    tokens: int = 0
    pairs: int = 0
    flops: int = 0
    weight_bytes: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    routed: dict[int, np.ndarray] | None = None  # layer -> pairs routed to each expert

    def add(self, other: FusedTotals):
        """Adds `other`'s figures and routed pairs to these."""
        for f in fields(self):
            if f.name != "routed":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for layer, counts in (other.routed or {}).items():
            self.routed[layer] = self.routed[layer] + counts if layer in self.routed else counts


@dataclass
class _NativeLayer:
    pointer: int  # the moe_layer
    routed: np.ndarray | None  # pairs routed to each expert, counted by the native code (a forward layer's)
    call: MoeCall
    weights: list  # the packed weights the moe_layer points into: kept alive with it


def best_kernel(store_dtype, quant: str | None = None) -> tuple[str, str]:
    """(kernel, "") for the fastest fused forward kernel this machine runs on a store of `store_dtype` (with
    `quant`, the one for those quantized weights), or ("", why none runs). host_kernels/choice.py decides from
    it; the constructor checks again (a SIGILL otherwise)."""
    dtype = np.dtype(store_dtype)
    if quant is not None and quant not in QUANTIZED:
        raise HostKernelError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTIZED)}")
    wanted = list(QUANTIZED[quant]) if quant else [name for name, k in KERNELS.items() if not k.quantized]
    reasons = []
    for name in wanted:
        if dtype in KERNELS[name].store_dtypes:
            usable, reason = KERNELS[name].status()
            if usable:
                return name, ""
            reasons.append(f"{name}: {reason}")
    return "", "; ".join(reasons) or f"no fused forward kernel for {dtype} weights"


def pack_layer(w: LayerExperts | QuantizedLayerExperts, kernel: str) -> list:
    """A layer's (w13, w2) per expert packed for `kernel` (w13's up columns from a block boundary); a quantized
    layer's are already packed (views of its arrays) and must be of the kernel's format."""
    k = KERNELS[kernel]
    if w.quant is not None:
        if k.format is None or k.format.name != w.quant:
            raise HostKernelError(f"{w.quant} experts cannot run on the {kernel} kernel")
        return [w.packed(e) for e in range(w.num_experts)]
    empty = HugePageArena().empty  # the layer's weights on huge pages (host_kernels/huge_pages.py)
    return [
        (
            k.pack(gate_up_blocks(w, e, k.block, k.pack_dtype), empty),
            k.pack(w.w2[e].astype(k.pack_dtype, copy=False), empty),
        )
        for e in range(w.num_experts)
    ]


# the kernels whose layers also run the fused backward (csrc/moe_backward.c): bfloat16 weights in amx.pack's layout
BACKWARD_KERNELS = (AMX_BF16, AVX512_BF16, AVX2_BF16)


class FusedForward:
    """Native runner (threads and buffers) plus one native layer per MoE layer, computed by `kernel` (default:
    `best_kernel`) over packed weights that `packed(layer)` returns as [(w13, w2) per expert]: the engine's AMX
    forward weights, or `pack_layer`'s. The native layer points into them: they are kept with it. With a
    BACKWARD_KERNELS kernel, `backward` runs a training step's backward over the weights that
    `packed_backward(layer)` returns as [(W2ᵀ, W13ᵀ) per expert] (the engine's backward GEMMs' packed weights).

    A layer is packed by `prepare` or, for calls from Python, when first used; the addresses a traced step embeds
    (`call_address`) exist only for prepared layers, so no packing happens while a step is traced."""

    def __init__(
        self,
        store: ExpertStore,
        packed,
        threads: int,
        kernel: str | None = None,
        packed_backward=None,
        glu: GLU = SWIGLU,
        gate_up_bias: Mapping[int, np.ndarray] | None = None,
    ):
        """`glu` and `gate_up_bias` (by layer: [experts, 2 ffn] float32, gate then up): the experts' function
        where it is not a plain SwiGLU without biases (GPT-OSS)."""
        if kernel is None:
            kernel, reason = best_kernel(store.dtype)
            if not kernel:
                raise HostKernelError(f"fused forward unavailable: {reason}")
        if kernel not in KERNELS or store.dtype not in KERNELS[kernel].store_dtypes:
            raise HostKernelError(f"fused forward kernel {kernel!r} cannot read a {store.dtype} store")
        quantized_as = KERNELS[kernel].format.name if KERNELS[kernel].quantized else None
        if store.quant is not None and quantized_as != store.quant:  # (a float store, any kernel quantizes it)
            raise HostKernelError(f"fused forward kernel {kernel!r} cannot read a {store.quant} store")
        usable, reason = KERNELS[kernel].status()
        if not usable:
            raise HostKernelError(f"fused forward unavailable: {kernel}: {reason}")
        check_thread_count(threads)
        self.store, self._packed, self.kernel = store, packed, kernel
        self.glu = glu
        self._gate_up_bias = {layer: np.ascontiguousarray(b, np.float32) for layer, b in (gate_up_bias or {}).items()}
        self._packed_backward = packed_backward if kernel in BACKWARD_KERNELS else None
        self._lib = native.lib()
        self._runner = self._lib.moe_runner_new(threads)
        if not self._runner:
            raise HostKernelError(f"cannot start the fused forward's {threads} threads")
        self.threads = self._lib.moe_runner_threads(self._runner)
        self._layers: dict[int, _NativeLayer] = {}
        self._backward_layers: dict[int, _NativeLayer] = {}
        self._lock = threading.Lock()
        self._reported = np.zeros(len(TOTAL_NAMES), np.uint64)
        self._routed_reported: dict[int, np.ndarray] = {}
        self._finalizer = weakref.finalize(self, _free, self._lib, self._runner, self._layers, self._backward_layers)

    def _layer(self, layer: int) -> _NativeLayer:
        with self._lock:
            entry = self._layers.get(layer)
            if entry is None:
                w = self.store[layer]
                weights = self._packed(layer)
                self._check_packed(layer, w, weights)
                bias = self._gate_up_bias.get(layer)
                want = (w.num_experts, 2 * w.ffn)
                if bias is not None and bias.shape != want:
                    raise HostKernelError(f"layer {layer}: gate/up biases {bias.shape}, its experts need {want}")
                routed = np.zeros(w.num_experts, np.int64)
                entry = self._layers[layer] = self._native_layer(layer, w.hidden, w.ffn, weights, routed)
                self._set_glu(entry, bias)
                self._routed_reported[layer] = np.zeros_like(routed)
            return entry

    def _native_layer(self, layer: int, hidden: int, ffn: int, weights, routed) -> _NativeLayer:
        """A moe_layer over `weights` [(first, second GEMM's packed weight) per expert], counting routed pairs
        into `routed` (None: not counted)."""
        first = np.array([p[0].data.ctypes.data for p in weights], np.uint64)
        second = np.array([p[1].data.ctypes.data for p in weights], np.uint64)
        pointer = self._lib.moe_layer_new(
            KERNELS[self.kernel].code, len(weights), hidden, ffn, first.ctypes.data, second.ctypes.data,
            None if routed is None else routed.ctypes.data, KERNELS[self.kernel].group,
        )  # fmt: skip
        if not pointer:
            raise HostKernelError(f"layer {layer}: out of memory for the fused forward's layer table")
        call = MoeCall()
        self._lib.moe_call_init(ctypes.addressof(call), self._runner, pointer)
        return _NativeLayer(pointer, routed, call, weights)

    @property
    def has_backward(self) -> bool:
        return self._packed_backward is not None

    def _backward_layer(self, layer: int) -> _NativeLayer:
        with self._lock:
            entry = self._backward_layers.get(layer)
            if entry is None:
                w = self.store[layer]
                weights = self._packed_backward(layer)
                self._check_packed(layer, w, weights, backward=True)
                entry = self._backward_layers[layer] = self._native_layer(layer, w.hidden, w.ffn, weights, None)
                self._set_glu(entry, None)  # its pre-activations were kept with their biases added
            return entry

    def _set_glu(self, entry: _NativeLayer, bias: np.ndarray | None):
        if self.glu != SWIGLU or bias is not None:
            code = self._lib.moe_layer_set_glu(entry.pointer, self.glu.code, self.glu.alpha, self.glu.limit,
                                               None if bias is None else bias.ctypes.data)  # fmt: skip
            if code:
                raise HostKernelError(f"the native library has no expert activation {self.glu.kind!r}")

    def _check_packed(self, layer: int, w: LayerExperts, weights, backward: bool = False):
        """The packed weights the native layer will read: one (w13, w2) per expert (a backward layer: (W2ᵀ,
        W13ᵀ)), of this store's kind and the layer's shape (each one's data was checked against its k and n when
        it was made)."""
        kind, block = KERNELS[self.kernel].packed, KERNELS[self.kernel].block
        names, want = ("w13", "w2"), ((w.hidden, 2 * amx.padded(w.ffn, block)), (w.ffn, w.hidden))
        if backward:
            names, want = ("W2ᵀ", "W13ᵀ"), ((w.hidden, w.ffn), (2 * w.ffn, w.hidden))
        if len(weights) != w.num_experts:
            raise KernelArgumentError(f"layer {layer}: {len(weights)} packed experts for {w.num_experts}")
        for e, pair in enumerate(weights):
            for name, packed, (k, n) in zip(names, pair, want, strict=True):
                where = f"layer {layer} expert {e} {name}"
                if not isinstance(packed, kind) or (packed.k, packed.n) != (k, n):
                    raise KernelArgumentError(f"{where}: expected a {kind.__name__} of k={k}, n={n}")

    def prepare(self, layers: Iterable[int], backward: bool = False):
        """Packs `layers` for the native calls (their backward layers with `backward`, which needs
        `has_backward`): the explicit step before a step that calls them is traced."""
        if backward and not self.has_backward:
            raise HostKernelError(f"the fused backward runs on {', '.join(BACKWARD_KERNELS)}, not {self.kernel}")
        build, built = (self._backward_layer, self._backward_layers) if backward else (self._layer, self._layers)
        with self._lock:
            missing = [layer for layer in layers if layer not in built]  # a second prepare packs nothing
        for layer in tqdm(missing, desc=f"packing experts for {self.kernel}", unit="layer", disable=None):
            build(layer)

    @property
    def packed_layers(self) -> tuple[int, ...]:
        """The layers whose native forward is packed (by `prepare` or a first call from Python)."""
        with self._lock:
            return tuple(sorted(self._layers))

    def call_address(self, layer: int) -> int:
        """Address of this prepared layer's `moe_call` (valid while this object lives; `is_live_call` says so)."""
        return self._address(self._layers, layer, "forward")

    def backward_call_address(self, layer: int) -> int:
        """Address of the `moe_call` naming this layer's prepared backward layer (its packed W2ᵀ / W13ᵀ) and the
        runner: a stream worker's backward runs the fused backward on it."""
        return self._address(self._backward_layers, layer, "backward")

    def _address(self, built: dict, layer: int, kind: str) -> int:
        with self._lock:
            entry = built.get(layer)
        if entry is None:
            flag, model_step = ", backward=True", "Model.prepare_for_training()"
            if kind == "forward":
                flag, model_step = "", "load_model"
            raise HostKernelError(
                f"layer {layer}'s fused {kind} is not packed: FusedForward.prepare([{layer}, ...]{flag}) runs "
                f"before a step that calls it is traced (a model's: {model_step})"
            )
        address = ctypes.addressof(entry.call)
        _LIVE_CALLS.add(address)
        return address

    def forward(self, layer: int, x_td: np.ndarray, ids_tk: np.ndarray, weights_tk: np.ndarray, keep: bool = False):
        """y [t, d] in x's dtype (float32 or bfloat16) = routed experts of `layer` applied to x. An id of
        schedule.NOT_ROUTED marks a pair computed elsewhere: it adds nothing here. With `keep`, (y, h): h float32
        [routed pairs, 2 * ffn], the gate/up pre-activations in expert-sorted order (schedule.Routing's), gate
        columns then up, as the engine's `forward_keeping` returns them for its backward."""
        pointer = self._layer(layer).pointer
        w = self.store[layer]
        x_td = np.ascontiguousarray(x_td)
        if x_td.ndim != 2 or x_td.shape[1] != w.hidden or x_td.dtype not in DTYPE_CODES:
            raise KernelArgumentError(f"layer {layer}: x is {x_td.dtype} {x_td.shape}, expected [tokens, {w.hidden}]")
        ids_tk = check_expert_ids(layer, ids_tk, x_td.shape[0], w.num_experts)
        weights_tk = np.ascontiguousarray(weights_tk)
        if weights_tk.shape != ids_tk.shape or (weights_tk.dtype.kind != "f" and weights_tk.dtype not in DTYPE_CODES):
            raise KernelArgumentError(
                f"layer {layer}: routing weights are {weights_tk.dtype} {weights_tk.shape}, expected floats "
                f"{ids_tk.shape}"
            )
        if weights_tk.dtype not in DTYPE_CODES:
            weights_tk = weights_tk.astype(np.float32)
        y = np.empty_like(x_td)
        message = ctypes.create_string_buffer(256)
        args = (
            self._runner, pointer, x_td.ctypes.data, DTYPE_CODES[x_td.dtype], ids_tk.ctypes.data,
            weights_tk.ctypes.data, DTYPE_CODES[weights_tk.dtype], x_td.shape[0], x_td.shape[1], ids_tk.shape[1],
            y.ctypes.data,
        )  # fmt: skip
        h = None
        if keep:
            h = np.empty((int(np.count_nonzero(ids_tk != NOT_ROUTED)), 2 * w.ffn), np.float32)
            status = self._lib.moe_forward_keeping(*args, h.ctypes.data, message, len(message))
        else:
            status = self._lib.moe_forward(*args, None, message, len(message))
        if status:
            raise HostKernelError(f"layer {layer}: {message.value.decode()}")
        return (y, h) if keep else y

    def backward(self, layer: int, x_td, ids_tk, weights_tk, dy_td, kept: np.ndarray):
        """(dx [t, d], d_weights [t, k]), float32, of `layer`'s routed experts given the output gradient dy, the
        forward's x (for its row count), ids, routing weights and the pre-activations its `forward(...,
        keep=True)` returned; the engine's `backward(..., saved=)` computes the same from Python."""
        if not self.has_backward:
            raise HostKernelError(f"the fused backward runs on {', '.join(BACKWARD_KERNELS)}, not {self.kernel}")
        pointer = self._backward_layer(layer).pointer
        w = self.store[layer]
        tokens = np.shape(x_td)[0]
        ids_tk = check_expert_ids(layer, ids_tk, tokens, w.num_experts)
        weights_tk = np.ascontiguousarray(weights_tk, np.float32)
        dy_td = np.ascontiguousarray(dy_td, np.float32)
        pairs = int(np.count_nonzero(ids_tk != NOT_ROUTED))
        if weights_tk.shape != ids_tk.shape or dy_td.shape != (tokens, w.hidden):
            raise KernelArgumentError(
                f"layer {layer}: routing weights {weights_tk.shape} and dy {dy_td.shape} do not fit ids "
                f"{ids_tk.shape} and hidden {w.hidden}"
            )
        if kept.dtype != np.float32 or kept.shape != (pairs, 2 * w.ffn) or not kept.flags.c_contiguous:
            raise KernelArgumentError(
                f"layer {layer}: kept pre-activations are {kept.dtype} {kept.shape}, expected float32 "
                f"[{pairs}, {2 * w.ffn}]"
            )
        dx, dweights = np.empty((tokens, w.hidden), np.float32), np.empty(ids_tk.shape, np.float32)
        message = ctypes.create_string_buffer(256)
        status = self._lib.moe_backward(
            self._runner, pointer, dy_td.ctypes.data, ids_tk.ctypes.data, weights_tk.ctypes.data, kept.ctypes.data,
            tokens, w.hidden, ids_tk.shape[1], dx.ctypes.data, dweights.ctypes.data, message, len(message),
        )  # fmt: skip
        if status:
            raise HostKernelError(f"layer {layer}: {message.value.decode()}")
        return dx, dweights

    def take_totals(self) -> FusedTotals:
        """Calls, time, tokens, bytes and routing since the previous take."""
        now = np.zeros(len(TOTAL_NAMES), np.uint64)
        self._lib.moe_runner_totals(self._runner, now.ctypes.data)
        delta, self._reported = now - self._reported, now
        totals = FusedTotals(**{name: int(v) for name, v in zip(TOTAL_NAMES, delta, strict=True)}, routed={})
        totals.seconds, totals.xla_call_seconds, totals.busy_seconds = (int(v) / 1e9 for v in delta[1:4])
        with self._lock:
            for layer, entry in self._layers.items():
                counts = entry.routed.copy()
                totals.routed[layer] = counts - self._routed_reported[layer]
                self._routed_reported[layer] = counts
        return totals


_LIVE_CALLS: set[int] = set()  # moe_call addresses handed out and not yet freed


def is_live_call(address: int) -> bool:
    """Whether `address` is a `moe_call` of a FusedForward still alive (anything else would crash the handler)."""
    return address in _LIVE_CALLS


def _free(lib, runner, layers, backward_layers):
    entries = (*layers.values(), *backward_layers.values())
    _LIVE_CALLS.difference_update(ctypes.addressof(entry.call) for entry in entries)
    lib.moe_runner_free(runner)
    for entry in entries:
        lib.moe_layer_free(entry.pointer)
