"""GEMMs over int4 weights with a float16 scale per group of k-rows and column, on AVX512-VNNI
(host_kernels/csrc/int4_gemm.c) or AVX2 (csrc/avx2_quantized_gemm.c), and the packed layout they read. bfloat16
rows in, float32 out.

How it works and why: docs/INTERNALS.md, host_kernels/int4_gemm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels import amx, bf16_gemm, native
from host_kernels.amx import K_BLOCK, N_BLOCK, aligned_empty, padded
from host_kernels.errors import HostKernelError, KernelArgumentError
from host_kernels.quant import QuantizedInt4

SCALE_BYTES = 2 * N_BLOCK  # a group's scales, after its nibbles
CPU_FLAGS = {  # each variant's (f16c: the float16 scales)
    native.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    native.AVX2: (*native.AVX2_CPU_FLAGS, "f16c"),
}


def block_bytes(kp: int, group: int) -> int:
    """Bytes of one 16-column block: kp / 8 rows of 64 bytes (8 k-rows of nibbles), and 32 bytes of scales per
    group."""
    return kp * N_BLOCK // 2 + -(-kp // group) * SCALE_BYTES


def group_bytes(group: int) -> int:
    """Bytes of one full group in a block: its nibbles, then its scales (a group starts at a multiple of this)."""
    return group * N_BLOCK // 2 + SCALE_BYTES


@dataclass(frozen=True)
class PackedInt4:
    data: np.ndarray  # uint8 [n blocks, block_bytes(kp, group)], 64-byte aligned
    k: int
    n: int
    group: int

    @property
    def kp(self) -> int:
        return padded(self.k, K_BLOCK)

    def __post_init__(self):
        self.validate()

    def validate(self, what: str = "packed int4 weight"):
        """The data is exactly what k, n and group say; checked when made, so `gemm` need not check it again."""
        shape = (padded(self.n, N_BLOCK) // N_BLOCK, block_bytes(self.kp, self.group))
        native.check_packed(what, self.data, np.uint8, shape)


def pack(w: QuantizedInt4, empty=aligned_empty) -> PackedInt4:
    """A [k, n] quantized weight in the packed layout (zeros in the padding: q = 0, scale 0 past k and n), in an
    array from `empty`."""
    if w.q.ndim != 2:
        raise KernelArgumentError(f"pack takes one [k, n] weight, got {w.q.shape}")
    k, n = w.q.shape
    kp, np_, group = padded(k, K_BLOCK), padded(n, N_BLOCK), w.group
    blocks, groups = np_ // N_BLOCK, -(-kp // group)
    full = np.zeros((kp, np_), np.uint8)
    full[:k, :n] = w.q + 8
    full[k:, :] = full[:, n:] = 8  # q = 0
    scales = np.zeros((groups, np_), np.float16)
    scales[: w.scale.shape[0], :n] = w.scale
    scales = scales.reshape(groups, blocks, N_BLOCK).transpose(1, 0, 2).view(np.uint8)  # [block][group][32 bytes]
    data = empty((blocks, block_bytes(kp, group)), np.uint8)
    write_layout(data, full, scales, group)
    return PackedInt4(data, k, n, group)


def write_layout(data: np.ndarray, nibbles: np.ndarray, scales: np.ndarray, group: int):
    """Fills `data` [blocks, block_bytes(kp, group)] with the 4-bit values `nibbles` (uint8 [kp, blocks * 16], each in
    [0, 15]) in the packed layout and each group's 32 scale bytes `scales` ([blocks, groups, 32] uint8) after its
    nibbles (shared by int4's float16 scales and MXFP4's exponents)."""
    kp, blocks = nibbles.shape[0], data.shape[0]
    # [block][8-row slab][column][i][half]: byte 4c + i of a slab's 64 holds rows 8r + i and 8r + 4 + i
    slabs = nibbles.reshape(kp // 8, 2, 4, blocks, N_BLOCK).transpose(3, 0, 4, 2, 1)
    packed = (slabs[..., 0] | (slabs[..., 1] << 4)).reshape(blocks, kp // 8, 64)
    for g in range(scales.shape[1]):
        rows = packed[:, g * group // 8 : (g + 1) * group // 8]  # the last group may be shorter
        start = g * group_bytes(group)
        data[:, start : start + rows.shape[1] * 64] = rows.reshape(blocks, -1)
        data[:, start + rows.shape[1] * 64 : start + rows.shape[1] * 64 + SCALE_BYTES] = scales[:, g]


def read_layout(data: np.ndarray, kp: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """`write_layout`'s inverse: (nibbles [kp, blocks * 16], scale bytes [blocks, groups, 32])."""
    blocks = data.shape[0]
    nibbles, scales = [], []
    for start in range(0, kp, group):
        rows = min(group, kp - start) // 8  # 64-byte rows of 8 k-rows; the last group may be shorter
        at = start // group * group_bytes(group)
        nibbles.append(data[:, at : at + rows * 64].reshape(blocks, rows, 64))
        scales.append(data[:, at + rows * 64 : at + rows * 64 + SCALE_BYTES])
    packed = np.concatenate(nibbles, axis=1).reshape(blocks, kp // 8, N_BLOCK, 4)  # [block][slab][column][i]
    values = np.stack([packed & 15, packed >> 4], axis=2)  # [block][slab][half][column][i]: k-row 8r + 4 half + i
    return values.transpose(1, 2, 4, 0, 3).reshape(kp, blocks * N_BLOCK), np.stack(scales, axis=1)


def unpack(w: PackedInt4) -> np.ndarray:
    """The float32 [k, n] weight a packed one holds ((stored - 8) * scale): what its products compute with. Native
    where a kernel variant runs (3x numpy's speed: training's backward dequantizes every expert it meets)."""
    isa, _ = native.best_isa(native.variant_statuses(CPU_FLAGS))
    return unpack_numpy(w) if isa is None else unpack_native(w, isa)


def unpack_native(w: PackedInt4, isa: str) -> np.ndarray:
    """`unpack` on the native variant `isa` (refused where this CPU cannot run it)."""
    native.pick_isa(native.variant_statuses(CPU_FLAGS), isa, "int4 unpack")
    blocks = w.data.shape[0]
    out = np.empty((w.k, blocks * N_BLOCK), np.float32)
    getattr(native.lib(), native.symbol("int4_unpack", isa))(
        w.data.ctypes.data, w.kp, w.group, blocks, w.k, out.ctypes.data, blocks * N_BLOCK
    )
    return out[:, : w.n]


def unpack_bf16_tiles(w: PackedInt4, transposed: bool = False, empty=aligned_empty) -> amx.PackedWeight:
    """`unpack`'s weights rounded to bfloat16 in the tile layout the bfloat16 GEMMs read (amx.pack_layout's), of W
    [k, n] or, `transposed`, of Wᵀ: bitwise amx.pack_layout(unpack(w)) (or of its transpose), made a block at a
    time with no float32 copy of the whole weight (training's GEMMs on an int4 base make every expert they meet).
    Needs the AVX-512 variant (`bf16_tiles_status`)."""
    native.pick_isa(native.variant_statuses(CPU_FLAGS), native.AVX512, "int4 unpack to bfloat16 tiles")
    k, n = (w.n, w.k) if transposed else (w.k, w.n)
    data = empty((padded(n, N_BLOCK) // N_BLOCK, padded(k, K_BLOCK) // K_BLOCK, K_BLOCK * N_BLOCK), np.uint16)
    scratch = np.empty((w.kp, N_BLOCK), np.float32)
    native.lib().int4_unpack_bf16_tiles(
        w.data.ctypes.data, w.kp, w.group, w.data.shape[0], w.k, w.n, int(transposed), data.ctypes.data,
        scratch.ctypes.data,
    )  # fmt: skip
    return amx.PackedWeight(data, k, n)


def bf16_tiles_status() -> tuple[bool, str]:
    """Whether `unpack_bf16_tiles` runs here."""
    return status(native.AVX512)


def unpack_numpy(w: PackedInt4) -> np.ndarray:
    """`unpack` in numpy."""
    nibbles, scales = read_layout(w.data, w.kp, w.group)
    q = nibbles.astype(np.float32) - 8
    scale = np.ascontiguousarray(scales).view(np.float16).astype(np.float32).transpose(1, 0, 2).reshape(-1, q.shape[1])
    return (q * np.repeat(scale, w.group, axis=0)[: w.kp])[: w.k, : w.n]


def status(isa: str = native.AVX512) -> tuple[bool, str]:
    return native.status(CPU_FLAGS[isa])


def gemm(
    a: np.ndarray, w: PackedInt4, out: np.ndarray, n0: int = 0, n1: int | None = None, isa: str | None = None
) -> np.ndarray:
    """out[:, :] = (a @ dequantized w)[:, n0:n1] in float32. `a`: bfloat16 rows (uint16) [m, >= w.kp] whose columns
    past w.k are zeros up to w.kp; `n0` a multiple of 16; `out` float32 [m, n1 - n0] with unit column stride.
    `isa`: the variant (default: the fastest this CPU runs)."""
    statuses = native.variant_statuses(CPU_FLAGS)
    if bf16_gemm.run("int4_gemm", a, w, out, n0, n1, w.group, statuses=statuses, isa=isa):
        raise HostKernelError(f"int4 GEMM: out of memory for {a.shape[0]} quantized rows")
    return out
