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

# DeepSeek / GLM / OLMoE: the families of issue 18. Kept apart from VARIANTS so the suites that run every backend
# over every variant choose which of these they can afford (test time).
QWEN3_NEXT = dict(
    num_experts=8,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    intermediate_size=40,
    num_experts_per_tok=3,
    head_dim=16,
)
# four layers of transformers' default pattern (full attention every 4th), two value heads per key head
GROUPED_DELTA_NET = dict(
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
)
DEEPSEEK_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
# DeepSeek-V3's grouped routing over 8 experts (V3.2's too), three layers, queries through a low rank
DEEPSEEK_V3_ROUTING = dict(
    **DEEPSEEK_MLA,
    q_lora_rank=12,
    n_routed_experts=8,
    moe_intermediate_size=16,
    n_shared_experts=1,
    intermediate_size=40,
    num_experts_per_tok=3,
    num_hidden_layers=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)
FAMILY_VARIANTS = {
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        dict(
            **DEEPSEEK_MLA,
            q_lora_rank=None,
            n_routed_experts=8,
            moe_intermediate_size=16,
            n_shared_experts=2,
            intermediate_size=40,
            first_k_dense_replace=1,
            num_experts_per_tok=3,
            num_hidden_layers=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    ),
    "deepseek_v2_q_lora": (
        transformers.DeepseekV2Config,
        dict(
            **DEEPSEEK_MLA,
            q_lora_rank=12,
            n_routed_experts=6,
            moe_intermediate_size=16,
            n_shared_experts=1,
            intermediate_size=40,
            topk_method="greedy",
        ),
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            **DEEPSEEK_V3_ROUTING,
            first_k_dense_replace=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=0.707,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    # DeepSeek-V3.2: V3 with the lightning indexer; prompts past 6 tokens attend sparsely (each query to its 6
    # best-scored tokens); its MLP layer types given, a dense layer between MoE ones
    "deepseek_v32": (
        transformers.DeepseekV32Config,
        dict(
            **DEEPSEEK_V3_ROUTING,
            mlp_layer_types=["sparse", "dense", "sparse"],
            index_n_heads=8,
            index_head_dim=16,
            index_topk=6,
            num_key_value_heads=4,  # (its attention repeats kv heads for heads / kv heads groups; MLA has none)
        ),
    ),
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        dict(
            n_routed_experts=8,
            moe_intermediate_size=16,
            n_shared_experts=1,
            intermediate_size=40,
            head_dim=16,
            first_k_dense_replace=1,
            num_experts_per_tok=3,
            num_hidden_layers=3,
            n_group=2,
            topk_group=1,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=1.8,
        ),
    ),
    "minimax_m2": (
        transformers.MiniMaxM2Config,
        dict(num_local_experts=8, intermediate_size=16, num_experts_per_tok=3, head_dim=16, rotary_dim=8),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            num_local_experts=8,
            intermediate_size=16,
            num_experts_per_tok=3,
            head_dim=16,
            sliding_window=5,
            num_hidden_layers=3,
            swiglu_limit=1.5,  # below the tiny model's pre-activations, so the clamps bind
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Qwen3-Next's default pattern (full attention every 4th layer), grouped value heads
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        dict(**QWEN3_NEXT, **GROUPED_DELTA_NET),
    ),
    # its layer types given, a dense layer, one value head per key head, attention biases
    "qwen3_next_layer_types": (
        transformers.Qwen3NextConfig,
        dict(
            **QWEN3_NEXT,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_only_layers=[0],
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=3,
            attention_bias=True,
        ),
    ),
    # Qwen3.5-MoE's language model (its text-only checkpoint; the multimodal one: test_qwen3_next.py): the DeltaNet's
    # projections apart
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeTextConfig,
        dict(**QWEN3_NEXT, **GROUPED_DELTA_NET),
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        dict(num_experts=8, intermediate_size=16, num_experts_per_tok=3, clip_qkv=3.0, norm_topk_prob=False),
    ),
}
ALL_VARIANTS = {**VARIANTS, **FAMILY_VARIANTS}
# The tiny Qwen3-Next carries float32 rounding far (transformers' own float32 logits of it are 1e-3 from its float64
# ones at 150 tokens): where two float32 computations of it are compared, this tolerance at least
AMPLIFIED_ROUNDING = {"qwen3_next": 2e-4}


def float32_atol(variant: str, atol: float) -> float:
    return max(atol, AMPLIFIED_ROUNDING.get(variant, 0.0))


# Qwen3-Next's and Qwen3.5's RMSNorms scale by 1 + w: their random weights are shifted down by one to scale as
# the others' do
UNIT_OFFSET_NORMS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def make_hf_model(variant: str, seed: int = 0, **overrides):
    config_cls, extra = ALL_VARIANTS[variant]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init gives near-uniform routing and tiny logits; widen the weights so routing and values differ a lot.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        # DeepSeek-V3 / GLM's routing correction bias is a buffer (zeros); random, it moves the expert choice
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
        if config.model_type in UNIT_OFFSET_NORMS:  # (not the DeltaNet's gated norm: a plain weight)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and ".linear_attn." not in name:
                    p -= 1.0
    return model


def save_hf_model(model, directory, max_shard_size=None):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
