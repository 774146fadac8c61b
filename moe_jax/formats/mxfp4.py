"""MXFP4 checkpoints (GPT-OSS as released), read as bfloat16 weights.

How it works and why: docs/INTERNALS.md, moe_jax/formats/mxfp4.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from host_kernels import QuantizedMXFP4
from host_kernels.quant import quantize_mxfp4
from moe_jax.errors import CheckpointError

BLOCKS, SCALES = "_blocks", "_scales"
# what openai/gpt-oss-* releases say in config.json (their attention weights are not quantized)
RELEASE_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
GROUP = 32  # values per scale


def is_mxfp4(hf_config: dict) -> bool:
    spec = hf_config.get("quantization_config") if isinstance(hf_config, dict) else None
    return isinstance(spec, dict) and spec.get("quant_method") == "mxfp4"


def codes(blocks: np.ndarray, scales: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(e2m1 codes uint8 [..., rows, groups * 32], e8m0 exponents [..., rows, groups]) of MXFP4 blocks and
    scales, checked."""
    _check(blocks, scales, where)
    values = np.empty((*blocks.shape[:-1], GROUP), np.uint8)
    values[..., 0::2], values[..., 1::2] = blocks & 0x0F, blocks >> 4
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP), scales


def dequantize(blocks: np.ndarray, scales: np.ndarray, where: str) -> np.ndarray:
    """bfloat16 [..., groups * 32, rows]: the blocks' values times their scales, last two dimensions swapped."""
    values, exponents = codes(blocks, scales, where)
    return QuantizedMXFP4(np.swapaxes(values, -1, -2), np.swapaxes(exponents, -1, -2)).dequantize(ml_dtypes.bfloat16)


def release_blocks(w_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) as a release stores a float weight [..., out, in] (the inverse of `codes`), quantized per 32
    inputs by ggml's rule (the host kernels' quantizer: a GGUF writer picks the same values)."""
    q = quantize_mxfp4(np.swapaxes(w_out_in, -1, -2))  # groups of 32 along k = in
    groups = np.swapaxes(q.codes, -1, -2).reshape(*w_out_in.shape[:-1], -1, GROUP)  # [..., out, in / 32, 32]
    return (groups[..., 0::2] | (groups[..., 1::2] << 4)).astype(np.uint8), np.swapaxes(q.exponents, -1, -2).copy()


def _check(blocks: np.ndarray, scales: np.ndarray, where: str):
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"{where}: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not fit ([..., groups, 16] and "
            "[..., groups])"
        )


class MXFP4Tensors:
    """A checkpoint's tensors (a safetensors_io.TensorSource) with each `X_blocks` + `X_scales` pair read as the
    bfloat16 weight `X`."""

    def __init__(self, source):
        self.source = source
        self.directory = source.directory

    def _pair(self, name: str) -> tuple[str, str] | None:
        blocks, scales = name + BLOCKS, name + SCALES
        return (blocks, scales) if blocks in self.source else None

    def __contains__(self, name: str) -> bool:
        return self._pair(name) is not None or (name in self.source and not name.endswith((BLOCKS, SCALES)))

    def names(self):
        out = []
        for n in self.source.names():
            if n.endswith(BLOCKS):
                out.append(n[: -len(BLOCKS)])
            elif not n.endswith(SCALES):
                out.append(n)
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        pair = self._pair(name)
        if pair is None:
            return self.source.shape(name)
        *lead, rows, groups, _ = self.source.shape(pair[0])
        return (*lead, groups * GROUP, rows)

    def dtype_code(self, name: str) -> str:
        return "BF16" if self._pair(name) else self.source.dtype_code(name)

    def release_pages(self):
        self.source.release_pages()

    def is_quantized(self, name: str) -> bool:
        return self._pair(name) is not None

    def codes(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Tensor `name`'s e2m1 codes [..., out, in] and e8m0 exponents [..., out, in / 32], as stored."""
        blocks, scales = self._parts(name)
        return codes(blocks, scales, f"{self.directory}: tensor {name!r}")

    def _parts(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        pair = self._pair(name)
        if pair is None or pair[1] not in self.source:
            raise CheckpointError(f"{self.directory}: MXFP4 tensor {name!r} needs both its {BLOCKS} and {SCALES}")
        return self.source.get(pair[0]), self.source.get(pair[1])

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if self._pair(name) is None:
            return self.source.get(name, shape)
        where = f"{self.directory}: tensor {name!r}"
        array = dequantize(*self._parts(name), where)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{where} has shape {tuple(array.shape)} (from its MXFP4 blocks), expected {shape}")
        return array
