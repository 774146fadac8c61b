"""Converted directories load like Hugging Face ones; bad checkpoints and inputs get one clear error."""

import json
import subprocess
import sys

import numpy as np
import pytest

import moe_jax
from moe_jax.convert import convert
from tests.hf_models import hf_logits, make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    hf = make_hf_model("mixtral", seed=5)
    path = tmp_path_factory.mktemp("mixtral")
    save_hf_model(hf, path)
    return hf, path


def test_converted_directory_gives_same_logits(mixtral, tmp_path):
    hf, path = mixtral
    out = convert(path, tmp_path / "converted", progress=False)
    assert (out / "experts" / "manifest.json").exists() and not (tmp_path / "converted.partial").exists()
    model = moe_jax.load_model(out, backend="device")
    assert model.checkpoint.is_converted
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 9))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_bfloat16_conversion_loads(mixtral, tmp_path):
    hf, path = mixtral
    out = convert(path, tmp_path / "bf16", dtype="bfloat16", progress=False)
    model = moe_jax.load_model(out, backend="device")
    ids = np.random.default_rng(0).integers(0, 96, size=(1, 9))
    # experts rounded to bfloat16: close to, not equal to, the float32 reference
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=0.25, rtol=0)


def test_convert_cli(mixtral, tmp_path):
    _, path = mixtral
    result = subprocess.run(
        [sys.executable, "-m", "moe_jax.convert", "--hf", str(path), "--out", str(tmp_path / "c")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "converting experts" in result.stderr  # the progress bar


def copy_checkpoint(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(moe_jax.CheckpointError, match="no such directory"):
        moe_jax.load_model(tmp_path / "nope", backend="device")


def test_missing_config(tmp_path):
    with pytest.raises(moe_jax.CheckpointError, match=r"config.json: not found"):
        moe_jax.load_model(tmp_path, backend="device")


def test_unsupported_model_type(mixtral, tmp_path):
    path = copy_checkpoint(mixtral[1], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(moe_jax.ConfigError, match="model_type 'llama' is not supported"):
        moe_jax.load_model(path, backend="device")


def test_misshapen_tensor(mixtral, tmp_path):
    path = copy_checkpoint(mixtral[1], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 40
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(moe_jax.CheckpointError, match=r"model.safetensors: tensor '.*' has shape .*, expected"):
        moe_jax.load_model(path, backend="device")


def test_missing_tensor(mixtral, tmp_path):
    from moe_jax.formats.safetensors_io import SafetensorsFile, save_safetensors

    path = copy_checkpoint(mixtral[1], tmp_path / "m")
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys() if k != "model.layers.1.self_attn.k_proj.weight"}
    del f
    save_safetensors(path / "model.safetensors", tensors)
    with pytest.raises(moe_jax.CheckpointError, match="'model.layers.1.self_attn.k_proj.weight' is missing"):
        moe_jax.load_model(path, backend="device")


def test_truncated_safetensors(mixtral, tmp_path):
    path = copy_checkpoint(mixtral[1], tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(moe_jax.CheckpointError, match=r"model.safetensors: truncated safetensors file"):
        moe_jax.load_model(path, backend="device")


def test_token_ids_outside_vocabulary(mixtral):
    model = moe_jax.load_model(mixtral[1], backend="device")
    with pytest.raises(moe_jax.InputError, match=r"token id 96 at position \(0, 2\) is outside the vocabulary"):
        model.logits(np.array([[1, 2, 96]]))
    with pytest.raises(moe_jax.InputError, match="token id -1"):
        model.generate([[3, -1]], max_new_tokens=2)


def test_unknown_backend(mixtral):
    with pytest.raises(moe_jax.InputError, match="unknown backend 'gpu'"):
        moe_jax.load_model(mixtral[1], backend="gpu")


def test_cli_exits_nonzero_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "moe_jax.convert", "--hf", str(tmp_path / "absent"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'absent'}: no such directory"
