"""Block-scaled FP8 checkpoints (DeepSeek/Qwen3 "-FP8" style): read as their dequantized weights, converted to
float or int stores, and refused with a clear error where they are not what they claim."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

import moe_jax
from moe_jax import convert
from moe_jax.errors import CheckpointError
from moe_jax.formats.safetensors_io import SafetensorsFile, save_safetensors
from tests.hf_models import make_hf_model, save_hf_model

BLOCK = (16, 8)  # small blocks, so that the tiny models' weights span several, with ragged edges
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 weight, scale_inv) as the FP8 releases store them: one scale per block of the last two dims."""
    rows, cols = weight.shape[-2:]
    br, bc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    padded = np.zeros((*weight.shape[:-2], br * BLOCK[0], bc * BLOCK[1]), np.float32)
    padded[..., :rows, :cols] = weight
    blocks = padded.reshape(*weight.shape[:-2], br, BLOCK[0], bc, BLOCK[1])
    scale = np.abs(blocks).max(axis=(-3, -1)) / FP8_MAX
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    full = np.repeat(np.repeat(scale, BLOCK[0], axis=-2), BLOCK[1], axis=-1)[..., :rows, :cols]
    return (weight / full).astype(ml_dtypes.float8_e4m3fn), scale


def fp8_checkpoint(variant, tmp_path):
    """(fp8 directory, a float32 directory holding exactly its dequantized weights, the largest error of a
    dequantized weight relative to its tensor's largest value)."""
    hf = make_hf_model(variant, seed=4)
    base = save_hf_model(hf, tmp_path / "base")
    source = SafetensorsFile(next(base.glob("*.safetensors")))
    fp8, dequantized, error = {}, {}, 0.0
    for name in source.keys():
        w = np.asarray(source.get(name), np.float32)
        if w.ndim >= 2 and "embed_tokens" not in name and "lm_head" not in name and not name.endswith("gate.weight"):
            q, scale = quantize(w)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            full = np.repeat(np.repeat(scale, BLOCK[0], axis=-2), BLOCK[1], axis=-1)[..., : w.shape[-2], : w.shape[-1]]
            dequantized[name] = q.astype(np.float32) * full
            error = max(error, float(np.abs(dequantized[name] - w).max() / np.abs(w).max()))
        else:
            fp8[name] = dequantized[name] = w
    config = json.loads((base / "config.json").read_text())
    directories = []
    for label, tensors, extra in (
        (
            "fp8",
            fp8,
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "weight_block_size": list(BLOCK),
                    "activation_scheme": "dynamic",
                }
            },
        ),
        ("dequantized", dequantized, {}),
    ):
        d = tmp_path / label
        d.mkdir()
        save_safetensors(d / "model.safetensors", tensors)
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        directories.append(d)
    return *directories, error


# the last two: released in FP8
@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "minimax_m2", "deepseek_v32"])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, variant):
    fp8_dir, reference_dir, error = fp8_checkpoint(variant, tmp_path)
    assert 0 < error <= 2**-4  # e4m3 keeps 3 mantissa bits: within half a step of 1/8 of the block's largest value
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 11))
    ours = moe_jax.load_model(fp8_dir).logits(ids)
    np.testing.assert_array_equal(ours, moe_jax.load_model(reference_dir).logits(ids))
    converted = tmp_path / "converted"
    convert.main(["--hf", str(fp8_dir), "--out", str(converted), "--quant", "int8"])
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    if variant == "deepseek_v32":  # past its top-k a rounding may flip the indexer's choice: a jump, not a drift
        ids, ours = ids[:, :6], ours[:, :6]
    int8 = moe_jax.load_model(converted).logits(ids)
    assert np.abs(int8 - ours).max() / np.abs(ours).max() < 0.05


def test_bad_fp8_checkpoints_are_named(tmp_path):
    fp8_dir, _, _ = fp8_checkpoint("mixtral", tmp_path)
    config = json.loads((fp8_dir / "config.json").read_text())
    for change, message in (
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        ({"weight_block_size": None}, "weight_block_size must be two positive integers"),
        ({"fmt": "e5m2"}, "fp8 format 'e5m2' is not supported"),
    ):
        bad = tmp_path / f"bad-{len(message)}"
        shutil.copytree(fp8_dir, bad)
        spec = {**config["quantization_config"], **change}
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": spec}))
        with pytest.raises(CheckpointError, match=message):
            moe_jax.load_model(bad)
    unscaled = tmp_path / "unscaled"
    shutil.copytree(fp8_dir, unscaled)
    (unscaled / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match="hold fp8 tensors .* but there is no quantization_config"):
        moe_jax.load_model(unscaled)
    source = SafetensorsFile(fp8_dir / "model.safetensors")
    tensors = {k: np.asarray(source.get(k)) for k in source.keys()}
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:1]
    save_safetensors(fp8_dir / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': scale_inv has shape"):
        moe_jax.load_model(fp8_dir)
