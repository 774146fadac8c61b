"""Hugging Face's names for a checkpoint's modules and tensors, in one place: what the model is built from
(`model.transformer.build_transformer`), what a checkpoint is checked and its experts read by (`checkpoint.py`),
what GGUF tensors are renamed to (`gguf_checkpoint.py`) and what an exported adapter calls its modules
(`adapters.py`)."""

from __future__ import annotations

import re

from moe_jax.model.config import ModelConfig

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm"
DENSE_MLP = "mlp"  # a dense layer's MLP under the layer
# multimodal families whose language model moe_jax runs: where its weights are (read as `model.`: checkpoint.py)
LANGUAGE_MODEL = {"qwen3_5_moe": "model.language_model."}
ATTENTION = "self_attn"
LINEAR_ATTENTION = "linear_attn"  # Qwen3-Next's Gated DeltaNet
# families whose released checkpoints keep Mixtral's names: `block_sparse_moe`, experts' w1 / w3 / w2
MIXTRAL_LAYOUT = ("mixtral", "minimax_m2")
# the routed experts' weights (held by the expert backends); their biases (GPT-OSS) are small and dense
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+\.|(gate_up_proj|down_proj)(_blocks|_scales)?$)")


def layer(i: int) -> str:
    return f"model.layers.{i}"


def attention(i: int) -> str:
    return f"{layer(i)}.{ATTENTION}"


def linear_attention(i: int) -> str:
    return f"{layer(i)}.{LINEAR_ATTENTION}"


def moe_module(config: ModelConfig) -> str:
    """A layer's MoE block under `model.layers.N` (Mixtral's and MiniMax's released checkpoints' name; transformers 5
    says `mlp`)."""
    return "block_sparse_moe" if config.model_type in MIXTRAL_LAYOUT else "mlp"


def shared_expert_module(config: ModelConfig) -> str:
    """The shared expert(s) under the MoE block."""
    return (
        "shared_experts"
        if config.model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe")
        else "shared_expert"
    )


def moe_block(config: ModelConfig, i: int) -> str:
    return f"{layer(i)}.{moe_module(config)}"


def shared_expert(config: ModelConfig, i: int) -> str:
    return f"{moe_block(config, i)}.{shared_expert_module(config)}"


def router(config: ModelConfig, i: int) -> str:
    """The router (a Linear over the experts) under the MoE block: `router` in GPT-OSS, `gate` elsewhere."""
    return f"{moe_block(config, i)}.{'router' if config.model_type == 'gpt_oss' else 'gate'}"


def expert_biases(config: ModelConfig, i: int) -> tuple[str, str]:
    """(gate_up, down) biases of a layer's experts (GPT-OSS: [e, 2f] gate and up interleaved, [e, d])."""
    p = f"{moe_block(config, i)}.experts"
    return f"{p}.gate_up_proj_bias", f"{p}.down_proj_bias"


def router_bias(config: ModelConfig, i: int) -> str:
    """The routing correction bias (DeepSeek-V3's e_score_correction_bias): the router's buffer, or (MiniMax-M2) the
    MoE block's."""
    owner = moe_block(config, i) if config.model_type == "minimax_m2" else f"{moe_block(config, i)}.gate"
    return f"{owner}.e_score_correction_bias"


def expert_names(config: ModelConfig, i: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one expert in the per-expert layout."""
    p = f"{moe_block(config, i)}.experts.{expert}"
    if config.model_type in MIXTRAL_LAYOUT:
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def fused_expert_names(config: ModelConfig, i: int) -> tuple[str, str]:
    """(gate_up, down) of a layer's experts in transformers 5's fused layout."""
    p = f"{moe_block(config, i)}.experts"
    return f"{p}.gate_up_proj", f"{p}.down_proj"


def is_expert_tensor(name: str) -> bool:
    return bool(EXPERT_TENSOR.search(name))


def module_name(path, config: ModelConfig) -> str:
    """moe_jax's module path (('layers', 0, 'mlp', 'shared', 'gate_proj')) as the Hugging Face module name (a
    multimodal release's: under its language model, `model.language_model.layers...`)."""
    parts = []
    for p in path:
        if p == "layers":
            parts.append(LANGUAGE_MODEL.get(config.model_type, "model.") + "layers")
        elif p == "shared":
            parts.append(shared_expert_module(config))
        elif p == "mlp":
            parts.append(moe_module(config))
        else:
            parts.append(str(p))
    return ".".join(parts)


def peft_module(name: str) -> str:
    """A Hugging Face module name as peft's wrapped model calls it (transformers 5's names: Mixtral's MoE block is
    `mlp` there, as Qwen's)."""
    return "base_model.model." + name.replace("block_sparse_moe", "mlp")
