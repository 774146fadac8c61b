"""Quantized weights for the experts (and a quantized model's dense decode products): int8 with a scale per output
column, int4 with a scale per group (llama.cpp's Q4_0 rule) and MXFP4 (the format GPT-OSS ships), each quantized,
dequantized and packed for its kernel.

How it works and why: docs/INTERNALS.md, host_kernels/quant.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels.errors import KernelArgumentError

INT8_MAX = 127
INT4_GROUPS = (32, 64, 128)  # k-rows per int4 scale the kernels take (a multiple of the 32-row k padding)


@dataclass(frozen=True)
class QuantizedInt8:
    """A [..., k, n] weight as int8 `q` and float32 `scale` [..., n] (one per output column)."""

    q: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        if self.q.dtype != np.int8 or self.scale.dtype != np.float32:
            raise KernelArgumentError(f"quantized weight is {self.q.dtype} with {self.scale.dtype} scales")
        if self.scale.shape != self.q.shape[:-2] + self.q.shape[-1:]:
            raise KernelArgumentError(f"scales {self.scale.shape} do not match int8 weights {self.q.shape}")

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        return (self.q.astype(np.float32) * self.scale[..., None, :]).astype(dtype)


@dataclass(frozen=True)
class QuantizedInt4:
    """A [..., k, n] weight as `q` (int8 values in [-8, 7]) and float16 `scale` [..., ceil(k / group), n]."""

    q: np.ndarray
    scale: np.ndarray
    group: int

    def __post_init__(self):
        if self.group not in INT4_GROUPS:
            raise KernelArgumentError(f"int4 group size {self.group}: choose one of {INT4_GROUPS}")
        if self.q.dtype != np.int8 or self.scale.dtype != np.float16:
            raise KernelArgumentError(f"int4 weight is {self.q.dtype} with {self.scale.dtype} scales")
        if self.q.size and not (-8 <= self.q.min() and self.q.max() <= 7):  # a nibble holds q + 8
            raise KernelArgumentError(f"int4 values must lie in [-8, 7], got [{self.q.min()}, {self.q.max()}]")
        k = self.q.shape[-2] if self.q.ndim >= 2 else 0
        if self.scale.shape != self.q.shape[:-2] + (-(-k // self.group),) + self.q.shape[-1:]:
            raise KernelArgumentError(
                f"scales {self.scale.shape} do not match int4 weights {self.q.shape} in groups of {self.group}"
            )

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        scale = np.repeat(self.scale.astype(np.float32), self.group, axis=-2)[..., : self.q.shape[-2], :]
        return (self.q.astype(np.float32) * scale).astype(dtype)


def quantize_int4(w: np.ndarray, group: int = 32) -> QuantizedInt4:
    """int4 per group of `group` k-rows and output column of a [..., k, n] float weight (llama.cpp's Q4_0 rule,
    the scale rounded to float16 before the weights are divided by it). A group of zeros gets scale 0; a
    non-finite weight is refused, naming where it is."""
    if group not in INT4_GROUPS:
        raise KernelArgumentError(f"int4 group size {group}: choose one of {INT4_GROUPS}")
    w32 = _finite_float32(w)
    k, n = w32.shape[-2:]
    groups = -(-k // group)
    padded = np.zeros(w32.shape[:-2] + (groups * group, n), np.float32)
    padded[..., :k, :] = w32
    blocks = padded.reshape(w32.shape[:-2] + (groups, group, n))
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-2)[..., None, :], axis=-2)[..., 0, :]
    with np.errstate(over="ignore"):
        scale = (extreme / -8).astype(np.float16)
    if not np.isfinite(scale).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(scale))[0])
        raise KernelArgumentError(f"int4 group {where}: its weights exceed float16 scales' range (|w| > 5.2e5)")
    safe = np.where(scale != 0, scale.astype(np.float32), 1.0)[..., None, :]
    q = np.clip(np.rint(blocks / safe), -8, 7).astype(np.int8).reshape(padded.shape)[..., :k, :]
    return QuantizedInt4(q, scale, group)


MXFP4_GROUP = 32
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@dataclass(frozen=True)
class QuantizedMXFP4:
    """A [..., k, n] weight as e2m1 `codes` (uint8 in [0, 15]) and e8m0 `exponents` [..., ceil(k / 32), n] (uint8:
    the group's power of two is 2^(e - 127))."""

    codes: np.ndarray
    exponents: np.ndarray

    def __post_init__(self):
        if self.codes.dtype != np.uint8 or self.exponents.dtype != np.uint8:
            raise KernelArgumentError(f"MXFP4 weight is {self.codes.dtype} with {self.exponents.dtype} exponents")
        if self.codes.size and self.codes.max() > 15:
            raise KernelArgumentError(f"MXFP4 codes must lie in [0, 15], got up to {self.codes.max()}")
        k = self.codes.shape[-2] if self.codes.ndim >= 2 else 0
        want = self.codes.shape[:-2] + (-(-k // MXFP4_GROUP),) + self.codes.shape[-1:]
        if self.exponents.shape != want:
            raise KernelArgumentError(f"exponents {self.exponents.shape} do not match MXFP4 codes {self.codes.shape}")

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        k = self.codes.shape[-2]
        scale = np.ldexp(np.float32(1), self.exponents.astype(np.int32) - 127).astype(np.float32)
        return (E2M1_VALUES[self.codes] * np.repeat(scale, MXFP4_GROUP, axis=-2)[..., :k, :]).astype(dtype)


def quantize_mxfp4(w: np.ndarray) -> QuantizedMXFP4:
    """MXFP4 per group of 32 k-rows and output column of a [..., k, n] float weight, by ggml's rule (so a GGUF
    file's MXFP4 blocks and these agree code for code). A non-finite weight is refused, naming where it is."""
    w32 = _finite_float32(w)
    k, n = w32.shape[-2:]
    groups = -(-k // MXFP4_GROUP)
    padded = np.zeros(w32.shape[:-2] + (groups * MXFP4_GROUP, n), np.float32)
    padded[..., :k, :] = w32
    blocks = padded.reshape(w32.shape[:-2] + (groups, MXFP4_GROUP, n))
    top = np.abs(blocks).max(axis=-2)
    with np.errstate(divide="ignore"):
        exponent = np.where(top > 0, np.floor(np.log2(top)) - 2, -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    step = np.ldexp(np.float32(1), exponent).astype(np.float32)[..., None, :, None]
    codes = np.abs(step * E2M1_VALUES - blocks[..., None]).argmin(axis=-1).astype(np.uint8)
    return QuantizedMXFP4(codes.reshape(padded.shape)[..., :k, :], (exponent + 127).astype(np.uint8))


def _finite_float32(w: np.ndarray) -> np.ndarray:
    """w as float32, refused if any weight is not finite (naming where)."""
    w32 = np.asarray(w, np.float32)
    if not np.isfinite(w32).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(w32))[0])
        raise KernelArgumentError(f"weight {w32[where]} at {where} is not finite: it cannot be quantized")
    return w32


def quantize_int8(w: np.ndarray) -> QuantizedInt8:
    """Symmetric int8 per output column of a [..., k, n] float weight. A column of zeros gets scale 0 (and stays
    zeros); a non-finite weight is refused, naming where it is."""
    w32 = _finite_float32(w)
    absmax = np.abs(w32).max(axis=-2)
    scale = (absmax / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)[..., None, :]
    q = np.clip(np.rint(w32 / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return QuantizedInt8(q, scale)


ACTIVATION_CHUNK = 32  # values per activation scale in the int4 kernel's products


def quantize_activations(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How the int4 kernel (host_kernels/csrc/int4_gemm.c) quantizes its bfloat16 rows, as llama.cpp's Q8_0 does:
    per 32 values of a [m, k] row (k a multiple of 32), d = max|a| / 127 and q = round(a / d) to nearest even,
    in float32. Returns (q int8 [m, k], d float32 [m, k / 32]); q * d is what the products see."""
    a32 = np.asarray(a, np.float32)
    m, k = a32.shape
    chunks = a32.reshape(m, k // ACTIVATION_CHUNK, ACTIVATION_CHUNK)
    d = np.abs(chunks).max(axis=-1) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(chunks * inverse[..., None]).astype(np.int8).reshape(m, k)
    return q, d.astype(np.float32)


INT16_ACTIVATION_CHUNK = 128  # values per activation scale in the VNNI int8 kernel's products (int8_vnni_gemm.h)


def quantize_activations_int16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How the AVX-512 int8 kernel's decode-sized products (host_kernels/csrc/int8_vnni_gemm.c) quantize bfloat16
    rows: per 128 values of a [m, k] row (the last chunk may be shorter), a power-of-two scale d = 2^(e - 14) for e
    the exponent of the chunk's largest magnitude (at least -112, where 1 / d would overflow), q = round(a / d) to
    nearest even. Returns (q int16 [m, k], d float32 [m, ceil(k / 128)]); q * d is what the products see."""
    a32 = np.asarray(a, np.float32)
    m, k = a32.shape
    chunks = -(-k // INT16_ACTIVATION_CHUNK)
    padded = np.zeros((m, chunks * INT16_ACTIVATION_CHUNK), np.float32)
    padded[:, :k] = a32
    padded = padded.reshape(m, chunks, INT16_ACTIVATION_CHUNK)
    largest = np.abs(padded).max(axis=-1)
    exponent = np.maximum(np.frexp(largest)[1] - 1, -112)
    d = np.where(largest > 0, np.ldexp(np.float32(1), exponent - 14), 0).astype(np.float32)
    q = np.rint(padded * np.ldexp(np.float32(1), 14 - exponent)[..., None].astype(np.float32))
    return q.astype(np.int16).reshape(m, -1)[:, :k], d
