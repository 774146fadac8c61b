"""Logits of every architecture match Hugging Face transformers on tiny random checkpoints."""

import json

import numpy as np
import pytest

import moe_jax
from moe_jax.errors import ConfigError
from tests.hf_models import ALL_VARIANTS, hf_logits, make_hf_model, save_hf_model

# rope scaling on families whose released configs use it (YaRN-extended Qwen3, ...), tried on the tiny models;
# dynamic NTK only scales past max_position_embeddings, so that is cut below the 13-token test sequences
ROPE_SCALING = {
    "yarn": ("qwen3_moe", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    "linear": ("mixtral", dict(rope_type="linear", factor=2.0)),
    "dynamic": ("qwen3_moe", dict(rope_type="dynamic", factor=3.0)),
    "llama3": (
        "mixtral",
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
}


def assert_logits_match(hf, path, batch=3, length=13, seed=1):
    model = moe_jax.load_model(path, backend="device")
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, size=(batch, length))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)
    return model


@pytest.mark.parametrize("variant", sorted(ALL_VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf = make_hf_model(variant)
    assert_logits_match(hf, save_hf_model(hf, tmp_path))


@pytest.mark.parametrize("kind", sorted(ROPE_SCALING))
def test_rope_scaling_matches_transformers(kind, tmp_path):
    family, params = ROPE_SCALING[kind]
    overrides = {"max_position_embeddings": 8} if kind == "dynamic" else {}
    hf = make_hf_model(family, rope_parameters={"rope_theta": 10000.0, **params}, **overrides)
    model = assert_logits_match(hf, save_hf_model(hf, tmp_path))
    assert model.config.rope.kind == kind


def test_unknown_rope_type_is_refused_by_name(tmp_path):
    hf = make_hf_model("mixtral")
    save_hf_model(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_type 'longrope' is not supported; supported: default, linear"):
        moe_jax.load_model(tmp_path, backend="device")


@pytest.mark.parametrize("variant", ["deepseek_v3", "glm4_moe"])
def test_sharded_checkpoint_of_a_grouped_router_family(variant, tmp_path):
    hf = make_hf_model(variant, seed=2)
    save_hf_model(hf, tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert_logits_match(hf, tmp_path, batch=2, length=9, seed=3)


def test_sharded_checkpoint_and_gqa_ratio(tmp_path):
    hf = make_hf_model("mixtral", num_attention_heads=8, num_key_value_heads=2, seed=3)
    save_hf_model(hf, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = moe_jax.load_model(tmp_path, backend="device")
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(2, 7))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_sliding_window_matches_transformers(tmp_path):
    hf = make_hf_model("mixtral", sliding_window=5)
    save_hf_model(hf, tmp_path)
    model = moe_jax.load_model(tmp_path, backend="device")
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, size=(2, 11))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("window", [None, 70])
def test_long_sequences_attend_in_chunks(tmp_path, window):
    hf = make_hf_model("qwen3_moe", sliding_window=window, use_sliding_window=window is not None, max_window_layers=0)
    save_hf_model(hf, tmp_path)
    model = moe_jax.load_model(tmp_path, backend="device")
    assert model.config.sliding_windows == (window, window)
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, size=(2, 150))  # > 2 query chunks
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)
