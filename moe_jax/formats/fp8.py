"""FP8 checkpoints with block scales (DeepSeek-V3/R1, Qwen3 and GLM "-FP8" releases), read as float weights.

Their `config.json` says `"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], ...}`;
each quantized `X.weight` is float8_e4m3 and has `X.weight_scale_inv` (float32), one scale per block of the last
two dimensions, such that the weight is `fp8 * scale_inv` block by block (transformers' `FP8Linear` and
DeepSeek's `weight_dequant`). moe_jax dequantizes each tensor as it is read, into float32 (and from there the
model's dtype, or an int format with `quant`); the scale tensors are not model weights and are hidden.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moe_jax.errors import CheckpointError, is_int

SCALE_SUFFIX = "_scale_inv"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def block_size(hf_config: dict, config_file) -> tuple[int, int] | None:
    """The (rows, columns) block of an FP8 checkpoint's scales; None when the checkpoint is not quantized. Any
    other quantization is refused by name (its weights would be read as garbage)."""
    spec = hf_config.get("quantization_config") if isinstance(hf_config, dict) else None
    if spec is None:
        return None
    method = spec.get("quant_method") if isinstance(spec, dict) else None
    if method != "fp8":
        raise CheckpointError(
            f"{config_file}: quantization_config quant_method {method!r} is not supported (only block-scaled fp8; "
            "for int8/int4 experts convert a float checkpoint with `python -m moe_jax.convert --quant`)"
        )
    if spec.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{config_file}: fp8 format {spec.get('fmt')!r} is not supported (only e4m3)")
    block = spec.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)):
        raise CheckpointError(
            f"{config_file}: weight_block_size must be two positive integers (per-tensor fp8 scales are not "
            f"supported), got {block!r}"
        )
    return block[0], block[1]


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], where: str) -> np.ndarray:
    """float32 `weight * scale_inv`, each scale covering a block of the last two dimensions."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{where}: scale_inv has shape {tuple(scale_inv.shape)}, expected {expected}")
    scale = np.asarray(scale_inv, np.float32)
    if not np.isfinite(scale).all():
        raise CheckpointError(f"{where}: scale_inv holds NaN or infinite values")
    scale = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)[..., :rows, :cols]
    return weight.astype(np.float32) * scale


class BlockScaledTensors:
    """A checkpoint's tensors (a safetensors_io.TensorSource) with FP8 weights read as float32; the scale
    tensors are hidden from names() (they are not model weights)."""

    def __init__(self, source, block: tuple[int, int]):
        self.source, self.block = source, block
        self.directory = source.directory

    def __contains__(self, name: str) -> bool:
        return name in self.source and not name.endswith(SCALE_SUFFIX)

    def names(self):
        return [n for n in self.source.names() if not n.endswith(SCALE_SUFFIX)]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def release_pages(self):
        self.source.release_pages()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        array = self.source.get(name, shape)
        if array.dtype != FP8:
            return array
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.source:
            raise CheckpointError(f"{self.directory}: fp8 tensor {name!r} has no {scale_name!r}")
        return dequantize(array, self.source.get(scale_name), self.block, f"{self.directory}: tensor {name!r}")
