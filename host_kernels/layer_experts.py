"""One layer's experts in memory, in the kernels' layout: `LayerExperts` (float: w13 [experts, hidden, 2 * ffn],
gate columns then up columns; w2 [experts, ffn, hidden]) and `QuantizedLayerExperts` (each expert packed for its
fused kernel, as store.py's quantized layout holds them), with the quantization and packing that make the second
from the first or from weights quantized elsewhere (`pack_int4_layer`)."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from host_kernels.amx import N_BLOCK, padded
from host_kernels.errors import KernelArgumentError, StoreError
from host_kernels.huge_pages import HugePageArena
from host_kernels.pool import default_threads
from host_kernels.quant import QuantizedInt4, QuantizedMXFP4
from host_kernels.quant_formats import FORMATS, INT4_BY_GROUP, QuantFormat

STORAGE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclass(frozen=True)
class LayerExperts:
    """One layer's expert weights in kernel layout (arrays may be memory-mapped, read-only)."""

    w13: np.ndarray  # [e, d, 2f]
    w2: np.ndarray  # [e, f, d]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[1]

    @property
    def ffn(self) -> int:
        return self.w2.shape[1]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights as stored."""
        return (self.w13[0].size + self.w2[0].size) * self.w13.dtype.itemsize

    @property
    def quant(self) -> str | None:
        return None

    def select(self, experts: range) -> LayerExperts:
        """Only `experts` (consecutive): views of the arrays, so a mapped store reads only their pages."""
        ends = slice(experts.start, experts.stop)
        return dataclasses.replace(self, w13=self.w13[ends], w2=self.w2[ends])

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @property
    def bytes_per_weight(self) -> float:
        return self.w13.dtype.itemsize

    def validate(self, name: str):
        e, d, f2 = self.w13.shape
        if self.w2.shape != (e, f2 // 2, d) or f2 % 2:
            raise StoreError(f"{name}: w13 shape {self.w13.shape} and w2 shape {self.w2.shape} do not fit together")
        if self.w13.dtype != self.w2.dtype or self.w13.dtype not in STORAGE_DTYPES.values():
            raise StoreError(f"{name}: unsupported storage dtypes {self.w13.dtype}/{self.w2.dtype}")


def gate_up_blocks(w: LayerExperts, e: int, block: int, dtype) -> np.ndarray:
    """Expert e's w13 [d, 2 fp] with the gate columns at [0, f) and the up columns at [fp, fp + f), fp = f rounded
    up to `block`: both halves start on a block boundary of the packed layout (zeros between)."""
    return gate_up_columns(w.w13[e], w.ffn, block, dtype)


def gate_up_columns(w13: np.ndarray, ffn: int, block: int, dtype=None) -> np.ndarray:
    """gate_up_blocks' layout for any array whose last axis holds the gate's `ffn` columns then the up's (one
    expert's weights, an int4 weight's codes or scales)."""
    fp = padded(ffn, block)
    out = np.zeros((*w13.shape[:-1], 2 * fp), dtype or w13.dtype)
    out[..., :ffn], out[..., fp : fp + ffn] = w13[..., :ffn], w13[..., ffn:]
    return out


@dataclass(frozen=True)
class QuantizedLayerExperts:
    """One layer's experts quantized in `quant`'s format, each packed for its fused kernel (a quantized store's
    mapped files, or `quantize_layer`'s arrays): w13_packed / w2_packed uint8 [experts, blocks, block bytes]."""

    quant: str
    w13_packed: np.ndarray
    w2_packed: np.ndarray
    hidden: int
    ffn: int

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.quant]

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def bytes_per_weight(self) -> float:
        """As the packed weights are read, scales aside."""
        return self.format.bits / 8

    @property
    def expert_bytes(self) -> int:
        return self.w13_packed[0].nbytes + self.w2_packed[0].nbytes

    @property
    def nbytes(self) -> int:
        return self.w13_packed.nbytes + self.w2_packed.nbytes

    def packed_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(k, n) of each expert's packed w13 (gate and up halves from 16-column blocks) and w2."""
        return packed_weight_shapes(self.hidden, self.ffn)

    def validate(self, name: str):
        if self.quant not in FORMATS:
            raise StoreError(f"{name}: unknown quantized format {self.quant!r}")
        arrays = (self.w13_packed, self.w2_packed)
        for what, array, (k, n) in zip(("w13", "w2"), arrays, self.packed_shapes(), strict=True):
            want = (self.num_experts, *self.format.packed_shape(k, n))
            if array.dtype != np.uint8 or array.shape != want:
                raise StoreError(f"{name}: {what} is {array.dtype} {array.shape}, {self.quant} needs uint8 {want}")

    def select(self, experts: range) -> QuantizedLayerExperts:
        """Only `experts` (consecutive): views of the arrays, so a mapped store reads only their pages."""
        ends = slice(experts.start, experts.stop)
        return dataclasses.replace(self, w13_packed=self.w13_packed[ends], w2_packed=self.w2_packed[ends])

    def packed(self, e: int) -> tuple:
        """Expert e's (w13, w2) as the fused kernel's packed weights: views of the arrays, no copy."""
        (k13, n13), (k2, n2) = self.packed_shapes()
        return self.format.wrap(self.w13_packed[e], k13, n13), self.format.wrap(self.w2_packed[e], k2, n2)

    def dequantized(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's float32 (w13 [hidden, 2 ffn], w2 [ffn, hidden]): the weights its kernel computes with."""
        w13_blocks, w2 = (self.format.unpack(p) for p in self.packed(e))
        f, fp = self.ffn, padded(self.ffn, N_BLOCK)
        if f == fp:  # the halves' blocks hold no padding: the unpacked blocks are w13 itself
            return w13_blocks, w2
        return np.concatenate([w13_blocks[:, :f], w13_blocks[:, fp : fp + f]], axis=1), w2


def packed_weight_shapes(hidden: int, ffn: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(k, n) of an expert's packed w13 (gate and up halves from 16-column blocks) and w2."""
    return (hidden, 2 * padded(ffn, N_BLOCK)), (ffn, hidden)


def quantized_expert_bytes(quant: str, hidden: int, ffn: int) -> int:
    """Bytes of one expert held in format `quant`, packed, scales included."""
    return sum(math.prod(FORMATS[quant].packed_shape(k, n)) for k, n in packed_weight_shapes(hidden, ffn))


def quantize_layer(w: LayerExperts, quant: str, name: str = "layer") -> QuantizedLayerExperts:
    """A float layer's experts quantized and packed in `quant`'s format (for a quantized store, or at load), the
    experts spread over the machine's cores (numpy's passes release the GIL: at Qwen3-30B-A3B's dims a layer is
    604M weights). A weight that is not finite is refused, named by `name`, expert, matrix and position (of the
    lowest expert with one)."""
    fmt = FORMATS[quant]

    def quantized(e: int):
        for matrix, array in (("w13 (gate | up)", w.w13[e]), ("w2 (down)", w.w2[e])):
            bad = np.argwhere(~np.isfinite(np.asarray(array, np.float32)))
            if bad.size:
                row, col = (int(i) for i in bad[0])
                value = array[row, col]
                raise StoreError(f"{name} expert {e} {matrix} [{row}, {col}] is {value}: it cannot be quantized")
        try:
            w13, w2 = fmt.quantize(gate_up_blocks(w, e, N_BLOCK, np.float32)), fmt.quantize(w.w2[e].astype(np.float32))
        except KernelArgumentError as err:  # weights too large for the format's scales
            raise StoreError(f"{name} expert {e}: {err}") from None
        return fmt.pack_quantized(w13).data, fmt.pack_quantized(w2).data

    with ThreadPoolExecutor(min(default_threads(), w.num_experts)) as pool:
        packed = list(pool.map(quantized, range(w.num_experts)))  # (in expert order: the lowest failure raises)
    return stack_layer(quant, packed, w.hidden, w.ffn)


def stack_layer(quant: str, packed: list, hidden: int, ffn: int) -> QuantizedLayerExperts:
    """A layer from its experts' packed (w13, w2) data, stacked on huge pages (host_kernels/huge_pages.py)."""
    arena = HugePageArena()

    def stacked(arrays):
        return np.stack(arrays, out=arena.empty((len(arrays), *arrays[0].shape), arrays[0].dtype))

    return QuantizedLayerExperts(quant, stacked([p[0] for p in packed]), stacked([p[1] for p in packed]), hidden, ffn)


def pack_int4_layer(w13_q, w13_scale, w2_q, w2_scale, group: int = 32) -> QuantizedLayerExperts:
    """Experts already quantized as int4 (codes int8 [e, k, n] in [-8, 7], float16 scales [e, k / group, n]; w13's
    columns the gate's then the up's, as LayerExperts'), packed as they are: no requantization, so weights
    quantized elsewhere by the same rule (llama.cpp's Q4_0) arrive bit for bit."""
    return _pack_quantized_layer(
        FORMATS[INT4_BY_GROUP[group]], lambda values, scales: QuantizedInt4(values, scales, group),
        w13_q, w13_scale, w2_q, w2_scale,
    )  # fmt: skip


def pack_mxfp4_layer(w13_codes, w13_exponents, w2_codes, w2_exponents) -> QuantizedLayerExperts:
    """Experts in MXFP4 (e2m1 codes uint8 [e, k, n], e8m0 exponents [e, k / 32, n]; w13 as in pack_int4_layer),
    packed code for code: a GPT-OSS checkpoint's or a GGUF file's MXFP4 experts compute with exactly their values."""
    return _pack_quantized_layer(FORMATS["mxfp4"], QuantizedMXFP4, w13_codes, w13_exponents, w2_codes, w2_exponents)


def _pack_quantized_layer(fmt: QuantFormat, quantized, w13_values, w13_scales, w2_values, w2_scales):
    """A layer of experts whose values and per-group scales arrive quantized already, each packed for `fmt`'s
    kernel (`quantized(values, scales)` makes the format's weight)."""
    experts, hidden, ffn = w13_values.shape[0], w13_values.shape[1], w2_values.shape[1]

    def packed(e: int):
        w13 = quantized(gate_up_columns(w13_values[e], ffn, N_BLOCK), gate_up_columns(w13_scales[e], ffn, N_BLOCK))
        w2 = quantized(np.ascontiguousarray(w2_values[e]), np.ascontiguousarray(w2_scales[e]))
        return fmt.pack_quantized(w13).data, fmt.pack_quantized(w2).data

    return stack_layer(fmt.name, [packed(e) for e in range(experts)], hidden, ffn)
