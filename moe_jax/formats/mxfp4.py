"""MXFP4 checkpoints (GPT-OSS as released), read as bfloat16 weights.

Their `config.json` says `"quantization_config": {"quant_method": "mxfp4", ...}`; each quantized expert tensor `X`
is stored as `X_blocks` (uint8 [..., rows, groups, 16]: 32 e2m1 values per group, two a byte, the low nibble first)
and `X_scales` (uint8 [..., rows, groups]: one e8m0 power of two per group, biased by 127), over the
[out, in] orientation; the weight transformers computes with is that dequantized and its last two dimensions
swapped (`integrations/mxfp4.py`). Every MXFP4 value times its power of two is exact in bfloat16, so reading them
as bfloat16 loses nothing; the blocks and scales themselves are hidden from names().
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moe_jax.errors import CheckpointError

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values per scale
# e2m1: sign, two exponent bits, one mantissa bit
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def is_mxfp4(hf_config: dict) -> bool:
    spec = hf_config.get("quantization_config") if isinstance(hf_config, dict) else None
    return isinstance(spec, dict) and spec.get("quant_method") == "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray, where: str) -> np.ndarray:
    """bfloat16 [..., groups * 32, rows]: the blocks' values times their scales, last two dimensions swapped."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"{where}: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not fit ([..., groups, 16] and "
            "[..., groups])"
        )
    values = np.empty((*blocks.shape[:-1], GROUP), np.float32)
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    out = values.reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP)
    return np.swapaxes(out, -1, -2).astype(ml_dtypes.bfloat16)


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

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        pair = self._pair(name)
        if pair is None:
            return self.source.get(name, shape)
        if pair[1] not in self.source:
            raise CheckpointError(f"{self.directory}: MXFP4 tensor {pair[0]!r} has no {pair[1]!r}")
        where = f"{self.directory}: tensor {name!r}"
        array = dequantize(self.source.get(pair[0]), self.source.get(pair[1]), where)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{where} has shape {tuple(array.shape)} (from its MXFP4 blocks), expected {shape}")
        return array
