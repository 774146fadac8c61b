"""The four GEMMs against one layer's expert weights that the engine needs, on the numpy path or on AMX.

How it works and why: docs/INTERNALS.md, host_kernels/expert_matmuls.py.
"""

from __future__ import annotations

import threading

import numpy as np

from host_kernels import amx, bf16_gemm, native
from host_kernels.errors import HostKernelError
from host_kernels.huge_pages import HugePageArena
from host_kernels.int4_gemm import PackedInt4, bf16_tiles_status, unpack_bf16_tiles
from host_kernels.layer_experts import LayerExperts, gate_up_blocks
from host_kernels.matmul import matmul_w
from host_kernels.quant_formats import FORMATS
from host_kernels.workspace import Workspace


class NumpyExpertMatmuls:
    """float32 BLAS; bfloat16 storage widened block by block (host_kernels/matmul.py)."""

    name = "numpy"
    makes_weights = False  # whether `weights(e)` makes them for the call (costly: dequantized) or reads them

    def __init__(self, w: LayerExperts):
        self.w = w

    def prepare(self, backward: bool):
        """Nothing to prepare: numpy reads the stored weights as they are."""

    def weights(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's (w13 [d, 2f], w2 [f, d]) as the GEMMs read them."""
        return self.w.w13[e], self.w.w2[e]

    def gate_up(self, e: int, x: np.ndarray, rows: np.ndarray | None, cols: slice):
        x = x if rows is None else x[rows]
        w13, f = self.weights(e)[0], self.w.ffn
        if cols.start == 0 and cols.stop == f:
            h = matmul_w(x, w13)
            return h[:, :f], h[:, f:]
        return matmul_w(x, w13[:, cols]), matmul_w(x, w13[:, f + cols.start : f + cols.stop])

    def input_buffer(self, name: str, rows: int, width: int, float32: bool = False) -> np.ndarray:
        """Where the engine writes the rows that `down` and `gate_up_t` read (activations, gate/up gradients)."""
        return np.empty((rows, width), np.float32)

    def down(self, e: int, act: np.ndarray, rows: slice, cols: slice, out: np.ndarray):
        matmul_w(act[rows], self.weights(e)[1][:, cols], out=out)

    def down_t(self, e: int, dy: np.ndarray, cols: slice) -> np.ndarray:
        return matmul_w(dy, self.weights(e)[1][cols, :], transpose=True)

    def gate_up_t(self, e: int, dh: np.ndarray, rows: slice, cols: slice, out: np.ndarray):
        matmul_w(dh[rows], self.weights(e)[0][cols, :], transpose=True, out=out)


class DequantizedExperts:
    """Float32 copies of a quantized store's experts, dequantized as the GEMMs meet them, for every layer of one
    engine together (one budget, however many layers the model has: a model's worth of float32 experts is 8x its
    int4 store). Kept: the first experts met, up to `keep_bytes` (the base is frozen, so they stay valid, and
    every step meets the experts in the same order, where a least-recently-used cache would keep none from one
    step to the next), and the last `recent` met (an expert's GEMMs come one after another: the engine's backward
    runs both passes of an expert in one task)."""

    def __init__(self, keep_bytes: int = 256 << 20, recent: int = 8):
        self.keep_bytes, self.recent = keep_bytes, recent
        self._kept: dict[tuple, tuple] = {}
        self._kept_bytes = 0
        self._recent: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def weights(self, layer: int, w, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e of `layer` (whose experts are `w`) as float32 (w13, w2)."""
        return self.get((layer, e), lambda: w.dequantized(e))

    def get(self, key: tuple, make):
        """The copy held under `key` (a tuple of arrays or packed weights), made by `make()` where none is."""
        with self._lock:
            found = self._kept.get(key) or self._recent.pop(key, None)
        if found is None:
            found = make()  # outside the lock: other threads' experts dequantize meanwhile
        with self._lock:
            size = _nbytes(found)
            if key not in self._kept and self._kept_bytes + size <= self.keep_bytes:
                self._kept[key], self._kept_bytes = found, self._kept_bytes + size
            elif key not in self._kept:
                self._recent[key] = found  # most recent last
                while len(self._recent) > self.recent:
                    del self._recent[next(iter(self._recent))]
        return found

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._kept_bytes + sum(_nbytes(found) for found in self._recent.values())


def _nbytes(arrays) -> int:
    return sum((a.data if isinstance(a, amx.PackedWeight) else a).nbytes for a in arrays)


class DequantizedExpertMatmuls(NumpyExpertMatmuls):
    """The same GEMMs over a quantized layer (store.QuantizedLayerExperts), each expert's weights dequantized to
    float32 when a GEMM first needs them (`DequantizedExperts`, shared by the engine's layers), so LoRA training on
    a quantized base (QLoRA's idea) computes with exactly the weights the fused forward reads."""

    name = "numpy-dequantized"
    makes_weights = True

    def __init__(self, w, layer: int, dequantized: DequantizedExperts):
        super().__init__(w)
        self.layer, self.dequantized = layer, dequantized

    def weights(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        return self.dequantized.weights(self.layer, self.w, e)


class AMXExpertMatmuls:
    """bfloat16 inputs and weights on AMX tiles, float32 accumulation. Column ranges must start at multiples of
    16 (the tile planner cuts at multiples of 32)."""

    name = "amx-bf16"
    makes_weights = False

    def __init__(self, w: LayerExperts, workspace: Workspace | None = None):
        self.w = w
        self.workspace = workspace or Workspace()
        self._lock = threading.Lock()
        self._forward: list[tuple[amx.PackedWeight, amx.PackedWeight]] | None = None
        self._backward: list[tuple[amx.PackedWeight, amx.PackedWeight]] | None = None

    def prepare(self, backward: bool):
        """Packs the weights a forward (and, when asked, a backward) reads; call before running tiles."""
        with self._lock:
            if self._forward is None:
                empty = HugePageArena().empty
                self._forward = [
                    (
                        self._pack(gate_up_blocks(self.w, e, amx.N_BLOCK, amx.BF16), empty),
                        self._pack(self.w.w2[e], empty),
                    )
                    for e in range(self.w.num_experts)
                ]
            if backward and self._backward is None:
                empty = HugePageArena().empty
                self._backward = [
                    (self._pack(np.asarray(self.w.w2[e]).T, empty), self._pack(np.asarray(self.w.w13[e]).T, empty))
                    for e in range(self.w.num_experts)
                ]

    @staticmethod
    def _pack(w, empty) -> amx.PackedWeight:
        return amx.pack(w, empty)

    @staticmethod
    def _mul(a, m: int, w: amx.PackedWeight, out, n0: int, n1: int):
        """out = (a[:m] @ w)[:, n0:n1]; `a` packed rows (amx.pack_rows / row_buffer, 16-row padded)."""
        return amx.gemm(a, m, w, out, n0, n1)

    def forward_weights(self) -> list[tuple[amx.PackedWeight, amx.PackedWeight]]:
        """(w13, w2) packed per expert, as the forward reads them (w13's up columns start at its n // 2)."""
        self.prepare(backward=False)
        return self._forward

    def backward_weights(self) -> list[tuple[amx.PackedWeight, amx.PackedWeight]]:
        """(W2ᵀ, W13ᵀ) packed per expert, as the backward reads them (the fused backward shares them)."""
        self.prepare(backward=True)
        return self._backward

    def _forward_pair(self, e: int) -> tuple[amx.PackedWeight, amx.PackedWeight]:
        """Expert e's packed (w13, w2) for the forward's GEMMs."""
        return self._forward[e]

    def _backward_pair(self, e: int) -> tuple[amx.PackedWeight, amx.PackedWeight]:
        """Expert e's packed (W2ᵀ, W13ᵀ) for the backward's GEMMs."""
        return self._backward[e]

    def gate_up(self, e: int, x: np.ndarray, rows: np.ndarray | None, cols: slice):
        w13 = self._forward_pair(e)[0]
        fp = w13.n // 2
        m = x.shape[0] if rows is None else rows.shape[0]
        a = self._packed_rows(x, w13.kp, rows, m)
        width = cols.stop - cols.start
        hg, hu = (self.workspace.get(name, (m, width), np.float32) for name in ("gate", "up"))
        self._mul(a, m, w13, hg, cols.start, cols.stop)
        self._mul(a, m, w13, hu, fp + cols.start, fp + cols.stop)
        return hg, hu

    def input_buffer(self, name: str, rows: int, width: int, float32: bool = False) -> np.ndarray:
        """bfloat16 rows the GEMMs read in place (written rounded by the SwiGLU passes), or float32 when the
        caller needs them so (LoRA terms): those are rounded per tile. In the workspace's buffer `name`."""
        if float32:
            return self.workspace.get(name, (rows, width), np.float32)
        return amx.row_buffer(rows, width, empty=lambda shape, dtype: self.workspace.get(name, shape, dtype))

    def _packed_rows(self, x, kp, rows, m):
        out = self.workspace.get("packed rows", (amx.padded(max(m, 1), amx.M_BLOCK), kp), np.uint16)
        return amx.pack_rows(x, kp, rows, out=out)

    def down(self, e: int, act: np.ndarray, rows: slice, cols: slice, out: np.ndarray):
        self._gemm(self._forward_pair(e)[1], act, rows, cols, out)

    def _gemm(self, w: amx.PackedWeight, a: np.ndarray, rows: slice, cols: slice, out: np.ndarray):
        m = rows.stop - rows.start
        a = a[rows.start :] if a.dtype == np.uint16 else self._packed_rows(a[rows], w.kp, None, m)
        self._mul(a, m, w, out, cols.start, cols.stop)

    def down_t(self, e: int, dy: np.ndarray, cols: slice) -> np.ndarray:
        w2t, m = self._backward_pair(e)[0], dy.shape[0]
        out = self.workspace.get("activation gradient", (m, cols.stop - cols.start), np.float32)
        return self._mul(self._packed_rows(dy, w2t.kp, None, m), m, w2t, out, cols.start, cols.stop)

    def gate_up_t(self, e: int, dh: np.ndarray, rows: slice, cols: slice, out: np.ndarray):
        self._gemm(self._backward_pair(e)[1], dh, rows, cols, out)


class AVX512BF16ExpertMatmuls(AMXExpertMatmuls):
    """The same GEMMs on AVX512-BF16 (host_kernels/bf16_gemm.py) for CPUs without AMX: it reads the same packed
    weights and bfloat16 rows, so only the product differs."""

    name = "avx512-bf16"

    @staticmethod
    def _pack(w, empty) -> amx.PackedWeight:
        return amx.pack_layout(w, empty)

    @staticmethod
    def _mul(a, m: int, w: amx.PackedWeight, out, n0: int, n1: int):
        return bf16_gemm.gemm(a[:m], w, out, n0, n1)


class AVX2BF16ExpertMatmuls(AVX512BF16ExpertMatmuls):
    """The same GEMMs on AVX2 + FMA (bf16_gemm.py's AVX2 variant: the weights widened to float32 in registers) for
    CPUs without AVX-512."""

    name = "avx2-bf16"

    @staticmethod
    def _mul(a, m: int, w: amx.PackedWeight, out, n0: int, n1: int):
        return bf16_gemm.gemm(a[:m], w, out, n0, n1, isa=native.AVX2)


MATMULS = {
    cls.name: cls for cls in (NumpyExpertMatmuls, AMXExpertMatmuls, AVX512BF16ExpertMatmuls, AVX2BF16ExpertMatmuls)
}


class DequantizedTileMatmuls(AMXExpertMatmuls):
    """The bfloat16 kernels' GEMMs over a quantized layer whose format dequantizes straight into their tile layout
    (int4 on AVX-512: int4_gemm.unpack_bf16_tiles), so LoRA training on a quantized base multiplies on the same
    kernels as on a bfloat16 one, with the dequantized weights rounded to bfloat16 (and, as there, bfloat16 rows).
    Each expert's tiles, the forward's (w13, w2) and the backward's (W2ᵀ, W13ᵀ) apart, are made when a GEMM first
    needs them, through the engine's DequantizedExperts (one budget for all layers); `product` is the bfloat16
    matmuls class whose product runs on them."""

    makes_weights = True

    def __init__(self, w, layer: int, dequantized: DequantizedExperts, product, workspace: Workspace | None = None):
        super().__init__(w, workspace)
        self.layer, self.dequantized = layer, dequantized
        self.name = f"{product.name}-dequantized"
        self._mul = product._mul

    def prepare(self, backward: bool):
        """Nothing to pack ahead: each expert's tiles are made when first needed."""

    def forward_weights(self):
        raise HostKernelError(f"{self.name}: no packed copies are kept (each expert's are made when used)")

    backward_weights = forward_weights

    def _forward_pair(self, e: int) -> tuple[amx.PackedWeight, amx.PackedWeight]:
        w13, w2 = self.w.packed(e)
        return self.dequantized.get((self.layer, e, "forward"), lambda: (unpack_bf16_tiles(w13), unpack_bf16_tiles(w2)))

    def _backward_pair(self, e: int) -> tuple[amx.PackedWeight, amx.PackedWeight]:
        w13, w2 = self.w.packed(e)
        return self.dequantized.get(
            (self.layer, e, "backward"), lambda: (unpack_bf16_tiles(w2, True), unpack_bf16_tiles(w13, True))
        )


def dequantizes_to_tiles(quant: str) -> bool:
    """Whether experts held in `quant` dequantize straight into the bfloat16 kernels' tiles on this CPU: int4
    formats, with the AVX-512 unpack (int4_gemm.unpack_bf16_tiles)."""
    return FORMATS[quant].packed_type is PackedInt4 and bf16_tiles_status()[0]


def _runs_on_tiles(w, gemm: str) -> bool:
    """Whether a quantized layer's GEMMs run on the bfloat16 kernels `gemm` (DequantizedTileMatmuls): its format
    dequantizes to their tiles, and its w13 halves are unpadded (so W13ᵀ's rows are the gradient's columns)."""
    bf16_kernels = (AMXExpertMatmuls.name, AVX512BF16ExpertMatmuls.name, AVX2BF16ExpertMatmuls.name)
    return gemm in bf16_kernels and dequantizes_to_tiles(w.quant) and w.ffn % amx.N_BLOCK == 0


def expert_matmuls(
    w, gemm: str, workspace: Workspace | None = None, layer: int = 0, dequantized: DequantizedExperts | None = None
):
    """The GEMMs `gemm` names (host_kernels/choice.py: a name in MATMULS) over `layer`'s experts `w`; a quantized
    layer's are always DequantizedExpertMatmuls, over `dequantized` (share one across layers: its budget is the
    engine's). The bfloat16 paths keep their temporaries in `workspace` (share one across layers too: only one
    layer runs at a time)."""
    if w.quant is not None:
        dequantized = dequantized or DequantizedExperts()
        if _runs_on_tiles(w, gemm):
            return DequantizedTileMatmuls(w, layer, dequantized, MATMULS[gemm], workspace)
        return DequantizedExpertMatmuls(w, layer, dequantized)
    if gemm == NumpyExpertMatmuls.name:
        return NumpyExpertMatmuls(w)
    return MATMULS[gemm](w, workspace)
