"""A GGUF file's Hugging Face `config.json`, built from its metadata (`{arch}.*` keys, as llama.cpp's converter
writes them) and its tensors' shapes, with llama.cpp's meaning where the two differ: a file means what llama.cpp
computes from it.

How it works and why: docs/INTERNALS.md, moe_jax/formats/gguf_config.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import gguf

from moe_jax.errors import CheckpointError

# llama.cpp architecture -> model_type (deepseek2 is decided by its gating function: model_type())
ARCHITECTURES = {
    "llama": "mixtral",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "glm4moe": "glm4_moe",
    "deepseek2": "deepseek_v2",
    "deepseek32": "deepseek_v32",
    "minimax-m2": "minimax_m2",
    "gpt-oss": "gpt_oss",
    "qwen3next": "qwen3_next",
    "qwen35moe": "qwen3_5_moe",
}


@dataclass(frozen=True)
class _Layout:
    """What the tensors say: the expert count, which layers are MoE, and the widths of each kind of MLP."""

    experts: int
    moe_layers: list[int]
    dense_layers: list[int]
    expert_ffn: int
    dense_ffn: int
    shared_ffn: int

    @classmethod
    def of(cls, file, layers: int) -> _Layout:
        moe = [i for i in range(layers) if file.layer_has(i, "ffn_gate_inp")]
        dense = [i for i in range(layers) if i not in moe]
        width = lambda name: file.tensor_shape(name)[-1] if name in file.tensors else 0  # noqa: E731
        return cls(
            experts=_int(file, "expert_count"),
            moe_layers=moe,
            dense_layers=dense,
            expert_ffn=width(f"blk.{moe[0]}.ffn_down_exps.weight") if moe else 0,
            dense_ffn=width(f"blk.{dense[0]}.ffn_down.weight") if dense else 0,
            shared_ffn=width(f"blk.{moe[0]}.ffn_down_shexp.weight") if moe else 0,
        )


def model_type(file) -> str:
    if file.arch != "deepseek2":
        return ARCHITECTURES[file.arch]
    sigmoid = int(file.arch_field("expert_gating_func", 0)) == int(gguf.ExpertGatingFuncType.SIGMOID)
    return "deepseek_v3" if sigmoid else "deepseek_v2"


def hf_config(file) -> dict:
    """config.json for a gguf_checkpoint.GGUFFile."""
    f = file.arch_field
    # glm4moe counts its multi-token-prediction layers among the blocks
    layers = _int(file, "block_count") - int(f("nextn_predict_layers", 0) or 0)
    kind = model_type(file)
    config = {
        "model_type": kind,
        "num_hidden_layers": layers,
        "hidden_size": _int(file, "embedding_length"),
        "num_attention_heads": _int(file, "attention.head_count"),
        "num_key_value_heads": int(f("attention.head_count_kv", _int(file, "attention.head_count"))),
        "rms_norm_eps": float(f("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(f("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "vocab_size": file.tensor_shape("token_embd.weight", ndim=2)[0],
        "rope_theta": float(f("rope.freq_base", 10000.0)),
        "num_experts_per_tok": _int(file, "expert_used_count"),
        **_rope_scaling(file),
    }
    for key in ("bos", "eos"):
        if file.field(f"tokenizer.ggml.{key}_token_id") is not None:
            config[f"{key}_token_id"] = int(file.field(f"tokenizer.ggml.{key}_token_id"))
    if "eos_token_id" not in config and file.field("tokenizer.ggml.tokens") is not None:
        eos = end_of_text_token(file)
        if eos is not None:
            config["eos_token_id"] = eos[0]
            warnings.warn(
                f"{file.path}: no tokenizer.ggml.eos_token_id; generation ends at its vocabulary's {eos[1]!r} "
                f"(token {eos[0]})",
                stacklevel=2,
            )
        else:
            warnings.warn(
                f"{file.path}: no tokenizer.ggml.eos_token_id and no end-of-text token in its vocabulary: "
                "generation runs to its token limit",
                stacklevel=2,
            )
    if f("attention.key_length") is not None and not kind.startswith("deepseek"):  # deepseek2's is MLA's latent
        config["head_dim"] = int(f("attention.key_length"))
    config.update(_READERS[file.arch](file, _Layout.of(file, layers), config))
    return config


# the end-of-text tokens of the tokenizers GGUF files carry, most specific first (a chat model's turn end before
# its document end: it is what its chat template ends an answer with)
END_OF_TEXT_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>")


def end_of_text_token(file) -> tuple[int, str] | None:
    """(id, text) of the first of END_OF_TEXT_TOKENS in the file's vocabulary, or None."""
    tokens = list(file.field("tokenizer.ggml.tokens") or [])
    where = {t: i for i, t in enumerate(tokens)}
    return next(((where[t], t) for t in END_OF_TEXT_TOKENS if t in where), None)


def _mixtral(file, layout: _Layout, config: dict) -> dict:
    return {"num_local_experts": layout.experts, "intermediate_size": layout.expert_ffn}


def _qwen(file, layout: _Layout, config: dict) -> dict:
    qwen2 = config["model_type"] == "qwen2_moe"
    return {
        "num_experts": layout.experts,
        "moe_intermediate_size": layout.expert_ffn,
        "intermediate_size": layout.dense_ffn,
        "mlp_only_layers": layout.dense_layers,
        "norm_topk_prob": not qwen2,
        **({"shared_expert_intermediate_size": layout.shared_ffn} if qwen2 else {}),
        # Qwen's q/k/v biases are its `qkv_bias`; its attention_bias is the output projection's
        "qkv_bias": "blk.0.attn_q.bias" in file.tensors,
        "attention_bias": "blk.0.attn_output.bias" in file.tensors,
    }


def _olmoe(file, layout: _Layout, config: dict) -> dict:
    clip = file.arch_field("attention.clamp_kqv")
    return {
        "num_experts": layout.experts,
        "intermediate_size": layout.expert_ffn,
        "norm_topk_prob": False,
        "clip_qkv": float(clip) if clip else None,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
    }


def _glm4_moe(file, layout: _Layout, config: dict) -> dict:
    head_dim = _head_dim(config)
    return {
        **_grouped_experts(file, layout),
        "head_dim": head_dim,
        "partial_rotary_factor": int(file.arch_field("rope.dimension_count", head_dim)) / head_dim,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "num_nextn_predict_layers": 0,  # not read: moe_jax runs the main layers
    }


def _minimax_m2(file, layout: _Layout, config: dict) -> dict:
    head_dim = _head_dim(config)
    gating = int(file.arch_field("expert_gating_func", gguf.ExpertGatingFuncType.SIGMOID))
    if gating != int(gguf.ExpertGatingFuncType.SIGMOID):
        raise CheckpointError(f"{file.path}: minimax-m2 with expert gating function {gating} (moe_jax runs sigmoid)")
    return {
        "num_local_experts": layout.experts,
        "intermediate_size": layout.expert_ffn,
        "head_dim": head_dim,
        "rotary_dim": int(file.arch_field("rope.dimension_count", head_dim)),
    }


def _gpt_oss(file, layout: _Layout, config: dict) -> dict:
    """llama.cpp's gpt-oss graph: every other layer sliding from the first (its default pattern), the clamped
    SwiGLU's constants fixed at GPT-OSS's, YaRN as the file says (ggml truncates its correction range)."""
    layers, f = config["num_hidden_layers"], file.arch_field
    pattern = f("attention.sliding_window_pattern")
    if pattern is not None and not isinstance(pattern, int):
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern or 2)
        sliding = [i % period < period - 1 for i in range(layers)]
    # without scaling metadata llama.cpp rotates plainly (transformers' GPT-OSS default would be YaRN)
    plain = {} if "rope_scaling" in config else {"rope_parameters": {"rope_type": "default"}}
    return {
        **plain,
        "num_local_experts": layout.experts,
        "intermediate_size": layout.expert_ffn,
        "head_dim": _head_dim(config),
        "sliding_window": int(file.arch_field("attention.sliding_window", 128)),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding[:layers]],
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
    }


def _qwen3_next(file, layout: _Layout, config: dict) -> dict:
    """llama.cpp's qwen3next / qwen35moe: the layers its `attention.recurrent_layers` marks are Gated DeltaNet, else
    all but every `full_attention_interval`-th (4); the chosen experts' weights always renormalised."""
    f, layers = file.arch_field, config["num_hidden_layers"]
    head_dim = _head_dim(config)
    recurrent = f("attention.recurrent_layers")
    if recurrent is not None and not isinstance(recurrent, (int, bool)):
        linear = [bool(r) for r in list(recurrent)[:layers]]
    else:
        interval = int(f("full_attention_interval", 4))
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads = _int(file, "ssm.time_step_rank")
    full = next((i for i, is_linear in enumerate(linear) if not is_linear), None)
    return {
        "num_experts": layout.experts,
        "moe_intermediate_size": layout.expert_ffn,
        "shared_expert_intermediate_size": layout.shared_ffn,
        "intermediate_size": layout.dense_ffn,
        "mlp_only_layers": layout.dense_layers,
        "norm_topk_prob": True,
        "head_dim": head_dim,
        "partial_rotary_factor": int(f("rope.dimension_count", head_dim // 4)) / head_dim,
        "layer_types": ["linear_attention" if is_linear else "full_attention" for is_linear in linear],
        "linear_conv_kernel_dim": _int(file, "ssm.conv_kernel"),
        "linear_key_head_dim": _int(file, "ssm.state_size"),
        "linear_num_key_heads": _int(file, "ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": _int(file, "ssm.inner_size") // v_heads,
        "attention_bias": full is not None and f"blk.{full}.attn_q.bias" in file.tensors,
    }


def _deepseek(file, layout: _Layout, config: dict) -> dict:
    f = file.arch_field
    rope_dim = _int(file, "rope.dimension_count")
    k_b = file.tensor_shape("blk.0.attn_k_b.weight", required=False, ndim=3)
    v_b = file.tensor_shape("blk.0.attn_v_b.weight", required=False, ndim=3)
    if k_b is not None and v_b is not None:  # [heads, rank, nope] and [heads, v, rank]
        nope, v_dim = k_b[2], v_b[1]
    elif f("attention.key_length_mla") is not None:  # a file with kv_b whole
        nope, v_dim = int(f("attention.key_length_mla")) - rope_dim, int(f("attention.value_length_mla"))
    else:
        raise CheckpointError(f"{file.path}: neither attn_k_b / attn_v_b nor key_length_mla give MLA's head sizes")
    groups = _grouped_experts(file, layout)
    if config["model_type"] == "deepseek_v2":
        groups["topk_method"] = "group_limited_greedy" if groups["n_group"] > 1 else "greedy"
    if config["model_type"] == "deepseek_v32":
        groups.update(_indexer(file))
    return {
        **groups,
        "num_key_value_heads": config["num_attention_heads"],  # llama.cpp writes MLA as one shared latent head
        "kv_lora_rank": _int(file, "attention.kv_lora_rank"),
        "q_lora_rank": int(f("attention.q_lora_rank", 0) or 0),  # 0: queries projected directly
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "rope_interleave": True,  # ggml's deepseek2 rotates interleaved pairs
        "attention_bias": "blk.0.attn_q_a.bias" in file.tensors or "blk.0.attn_kv_a_mqa.bias" in file.tensors,
    }


def _indexer(file) -> dict:
    """DeepSeek-V3.2's lightning indexer (its sigmoid routing is the only one llama.cpp's deepseek32 runs)."""
    gating = int(file.arch_field("expert_gating_func", gguf.ExpertGatingFuncType.SIGMOID))
    if gating != int(gguf.ExpertGatingFuncType.SIGMOID):
        raise CheckpointError(f"{file.path}: deepseek32 with expert gating function {gating} (moe_jax runs sigmoid)")
    return {
        "index_n_heads": _int(file, "attention.indexer.head_count"),
        "index_head_dim": _int(file, "attention.indexer.key_length"),
        "index_topk": _int(file, "attention.indexer.top_k"),
    }


def _grouped_experts(file, layout: _Layout) -> dict:
    """DeepSeek / GLM: leading dense layers, shared experts of the routed width, group-limited routing."""
    f = file.arch_field
    first_dense = layout.moe_layers[0] if layout.moe_layers else len(layout.dense_layers)
    if layout.dense_layers != list(range(first_dense)):
        raise CheckpointError(f"{file.path}: dense layers {layout.dense_layers} are not the leading ones")
    groups = int(f("expert_group_count", 1) or 1)
    return {
        "n_routed_experts": layout.experts,
        "moe_intermediate_size": layout.expert_ffn,
        "intermediate_size": layout.dense_ffn,
        "first_k_dense_replace": first_dense,
        "n_shared_experts": layout.shared_ffn // layout.expert_ffn if layout.expert_ffn else 0,
        "n_group": groups,
        "topk_group": int(f("expert_group_used_count", groups) or groups),
        "routed_scaling_factor": float(f("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(f("expert_weights_norm", False)),
    }


# by llama.cpp architecture: what each reads beyond the common keys
_READERS = {
    "llama": _mixtral,
    "qwen2moe": _qwen,
    "qwen3moe": _qwen,
    "olmoe": _olmoe,
    "glm4moe": _glm4_moe,
    "deepseek2": _deepseek,
    "deepseek32": _deepseek,
    "minimax-m2": _minimax_m2,
    "gpt-oss": _gpt_oss,
    "qwen3next": _qwen3_next,
    "qwen35moe": _qwen3_next,
}


def _rope_scaling(file) -> dict:
    f = file.arch_field
    kind, factor = f("rope.scaling.type"), f("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return {}
    if kind not in ("linear", "yarn"):
        raise CheckpointError(f"{file.path}: rope scaling {kind!r} is not supported (linear or yarn)")
    params = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        params["original_max_position_embeddings"] = _int(file, "rope.scaling.original_context_length")
        for key in ("beta_fast", "beta_slow"):
            if f(f"rope.scaling.yarn_{key}") is not None:
                params[key] = float(f(f"rope.scaling.yarn_{key}"))
        log_mul = f("rope.scaling.yarn_log_multiplier")
        if log_mul:
            params["mscale"] = params["mscale_all_dim"] = float(log_mul) / 0.1
    return {"rope_scaling": params}


def _head_dim(config: dict) -> int:
    """The attention head size: the file's key_length, else hidden size / heads."""
    return config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])


def _int(file, key: str) -> int:
    value = file.arch_field(key)
    if value is None:
        raise CheckpointError(f"{file.path}: GGUF metadata has no {file.arch}.{key}")
    return int(value)
