"""Tiny random Hugging Face checkpoints for the reference tests, one per architecture and variant."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, intermediate_size=40)),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=6,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            intermediate_size=48,
            norm_topk_prob=False,
        ),
    ),
    "qwen2_moe_norm_topk": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=6,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=16,
            num_experts_per_tok=8,
            moe_intermediate_size=16,
            intermediate_size=48,
            head_dim=16,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
}


def make_hf_model(variant: str, seed: int = 0, **overrides):
    config_cls, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init gives near-uniform routing and tiny logits; widen the weights so routing and values differ a lot.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model


def save_hf_model(model, directory, max_shard_size=None):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
