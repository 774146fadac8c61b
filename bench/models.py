"""The Mixtral-shaped bench model (~76M parameters) as a Hugging Face checkpoint, made once and cached.

hidden 512, ffn 1408, 4 layers, 8 heads, 2 KV heads, 8 experts top-2, vocab 4096: the shape the train and infer
issues measure against transformers. Random weights: speed does not depend on what they are.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

BENCH_SHAPE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
)


def bench_model_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "moe_jax_bench_mixtral"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**BENCH_SHAPE))
    model.save_pretrained(path)
    return path
