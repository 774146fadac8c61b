"""bfloat16 GEMMs on Intel AMX tiles (host_kernels/csrc/amx_gemm.c), and the packed weight layout they read.

`status()` says whether this machine can run them and, if not, why; the engine then falls back to the numpy path
(float32 BLAS, bfloat16 weights widened block by block). One GEMM per worker thread (ctypes releases the GIL).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import ml_dtypes
import numpy as np

from host_kernels import native
from host_kernels.errors import KernelArgumentError

BF16 = np.dtype(ml_dtypes.bfloat16)
K_BLOCK = 32  # k rows per AMX tile (16 pairs of bfloat16)
N_BLOCK = 16  # columns per AMX tile
M_BLOCK = 16  # rows per AMX tile
REQUIRED_CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")
# bf16_pack_rows's conversions, and its AVX2 variant's (avx2_gemm.c), fastest first
PACK_ROWS_CPU_FLAGS = {native.AVX512: ("avx512f", "avx512bw", "avx512_bf16"), native.AVX2: native.AVX2_CPU_FLAGS}
CACHE_LINE = 64


@dataclass(frozen=True)
class PackedWeight:
    """A [k, n] weight in AMX tile layout: [n blocks][k blocks][16 pairs][16 columns][2], zero-padded."""

    data: np.ndarray  # uint16 view of bfloat16 bits
    k: int
    n: int

    @property
    def kp(self) -> int:
        return self.data.shape[1] * K_BLOCK

    def __post_init__(self):
        self.validate()

    def validate(self, what: str = "packed weight"):
        """The data is exactly what k and n say (a hand-built one that is not would make `gemm` read past it);
        checked when made, so `gemm` need not check it again."""
        native.check_packed(
            what, self.data, np.uint16, (padded(self.n, N_BLOCK) // N_BLOCK, padded(self.k, K_BLOCK) // K_BLOCK, 512)
        )


def padded(size: int, block: int) -> int:
    return -(-size // block) * block


def aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty on a 64-byte boundary. numpy aligns to 16 bytes only, and a tile row (64 bytes) that straddles two
    cache lines costs two: GEMMs on unaligned buffers ran at under half their aligned rate."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def pack(w: np.ndarray, empty=aligned_empty) -> PackedWeight:
    """Packs a [k, n] weight (float32 or bfloat16; float32 is rounded to nearest even) for `gemm`. Refuses on a
    machine where `gemm` cannot run (and asks the OS for the tile state, once, where it can)."""
    usable, reason = status()
    if not usable:
        raise RuntimeError(f"AMX GEMM unavailable: {reason}")
    return pack_layout(w, empty)


def pack_layout(w: np.ndarray, empty=aligned_empty) -> PackedWeight:
    """The packed layout itself: also what the AVX512-BF16 GEMM reads (host_kernels/bf16_gemm.py). Written tile
    by tile natively (csrc/pack_layout.c: any strides, so the backward's transposed weights pack from views), or
    with numpy where the library is not built. Into an array from `empty` (aligned_empty's signature: a
    HugePageArena's `empty` puts it on huge pages)."""
    k, n = w.shape
    kp, np_ = padded(k, K_BLOCK), padded(n, N_BLOCK)
    data = empty((np_ // N_BLOCK, kp // K_BLOCK, K_BLOCK * N_BLOCK), np.uint16)
    bits = (w if w.dtype == BF16 else w.astype(BF16)).view(np.uint16)
    if native.status(())[0] and min(bits.strides) > 0 and k and n:
        strides = [s // bits.itemsize for s in bits.strides]
        native.lib().pack_bf16_tiles(bits.ctypes.data, *strides, k, n, data.ctypes.data)
        return PackedWeight(data, k, n)
    # each (even, odd) k-row pair of a column is one 32-bit word of the layout: moved as uint32 words
    full = np.zeros((kp, np_), np.uint16)
    full[:k, :n] = bits
    pairs = np.empty((kp // 2, np_, 2), np.uint16)  # [k pair][column][even, odd]
    pairs[...] = full.reshape(kp // 2, 2, np_).transpose(0, 2, 1)
    words = pairs.view(np.uint32).reshape(kp // K_BLOCK, K_BLOCK // 2, np_ // N_BLOCK, N_BLOCK)
    tiles = data.view(np.uint32).reshape(np_ // N_BLOCK, kp // K_BLOCK, K_BLOCK // 2, N_BLOCK)
    tiles[...] = words.transpose(2, 0, 1, 3)
    return PackedWeight(data, k, n)


def pack_rows(x: np.ndarray, kp: int, rows: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 copy of `x` (float32 [m, k], rows contiguous) — or of its rows `rows` — padded for `gemm`:
    [m rounded up to 16, kp], zeros in the padding; into `out` (aligned, that shape, uint16) when given."""
    isa = native.pick_isa(native.variant_statuses(PACK_ROWS_CPU_FLAGS), None, "bfloat16 row packing")
    if x.ndim != 2 or x.dtype != np.float32 or x.strides[1] != 4 or x.strides[0] < 0:
        raise KernelArgumentError(f"pack_rows needs float32 rows with unit column stride, got {x.dtype} {x.strides}")
    m = x.shape[0] if rows is None else rows.shape[0]
    k = x.shape[1]
    if kp % K_BLOCK or kp < k:
        raise KernelArgumentError(f"kp {kp} must be a multiple of {K_BLOCK} and at least the rows' {k} columns")
    if rows is not None:
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise KernelArgumentError(f"rows must be a 1-D integer array, got {rows.dtype} {rows.shape}")
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if m and (rows.min() < 0 or rows.max() >= x.shape[0]):
            raise KernelArgumentError(
                f"row index {rows.min() if rows.min() < 0 else rows.max()} outside [0, {x.shape[0]})"
            )
    shape = (padded(max(m, 1), M_BLOCK), kp)
    out = aligned_empty(shape, np.uint16) if out is None else out
    if out.shape != shape or out.dtype != np.uint16 or out.ctypes.data % CACHE_LINE or not out.flags.c_contiguous:
        raise KernelArgumentError(f"pack_rows output is {out.dtype} {out.shape}, expected aligned uint16 {shape}")
    native.check_writable("pack_rows output", out)
    getattr(native.lib(), native.symbol("bf16_pack_rows", isa))(
        x.ctypes.data,
        x.strides[0] // 4,
        None if rows is None else rows.ctypes.data,
        m,
        k,
        out.ctypes.data,
        kp,
        out.shape[0],
    )
    return out


def row_buffer(rows: int, width: int, empty=aligned_empty) -> np.ndarray:
    """An uninitialised bfloat16 (uint16) [rows, width] array that `gemm` reads as it is, also from any row on:
    each row padded with zeros to a multiple of 32 columns, and 16 spare rows after the last (a tile reads 16
    rows; what it reads past the rows asked for only reaches output that is never stored). `empty(shape, dtype)`
    allocates the aligned base (a Workspace's `get`, say)."""
    base = empty((rows + M_BLOCK, padded(width, K_BLOCK)), np.uint16)
    base[:, width:] = 0
    return base[:rows, :width]


def gemm(a: np.ndarray, m: int, w: PackedWeight, out: np.ndarray, n0: int = 0, n1: int | None = None) -> np.ndarray:
    """out[:m, :] = (a @ w)[:m, n0:n1] in float32. `a`: bfloat16 rows (uint16) from `pack_rows` or a
    `row_buffer` (or a view of one from some row on) with w.k columns before the padding; `n0` a multiple of 16;
    `out` a float32 [m, n1 - n0] array or view with unit column stride (rows may be strided)."""
    native.require(status(), "AMX GEMM")
    n1 = w.n if n1 is None else n1
    if a.dtype != np.uint16 or a.ndim != 2 or a.strides != (2 * w.kp, 2) or a.shape[1] < w.k:
        raise KernelArgumentError(
            f"packed rows are {a.dtype} {a.shape} strides {a.strides}, expected uint16 rows of {w.kp}"
        )
    if not 0 <= m <= a.shape[0]:
        raise KernelArgumentError(f"m = {m} rows asked of {a.shape[0]} packed rows")
    native.check_extent("packed rows", a, padded(m, M_BLOCK))  # a tile reads 16 rows
    native.check_gemm_output(out, m, n0, n1, w.n, N_BLOCK)
    native.lib().amx_gemm(
        a.ctypes.data, w.kp, w.data.ctypes.data, w.kp, out.ctypes.data, out.strides[0] // 4, m, n0, n1
    )
    return out


def status() -> tuple[bool, str]:
    """(usable, why not): the CPU has AMX-BF16, the library was built, and the OS grants the tile state."""
    usable, reason = native.status(REQUIRED_CPU_FLAGS)
    if not usable:
        return usable, reason
    return _permission()


@cache
def _permission() -> tuple[bool, str]:
    if native.lib().amx_request_permission() != 0:
        return False, "the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return True, ""
