"""Logits of every architecture match Hugging Face transformers on tiny random checkpoints."""

import numpy as np
import pytest

import moe_jax
from tests.hf_models import VARIANTS, hf_logits, make_hf_model, save_hf_model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf = make_hf_model(variant)
    save_hf_model(hf, tmp_path)
    model = moe_jax.load_model(tmp_path, backend="device")
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(3, 13))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


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
