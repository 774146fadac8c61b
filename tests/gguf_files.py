"""GGUF files written from tiny transformers models with the `gguf` package, laid out as llama.cpp's converter
(convert_hf_to_gguf.py) lays them out: tensor names from the package's own TensorNameMap, experts stacked per
layer, llama-architecture q/k rows permuted for ggml's rotary layout, DeepSeek's kv_b split into k_b (transposed)
and v_b, one-dimensional tensors in float32. `dequantized_model` gives the transformers model whose weights are
what the file holds after quantization: the reference a GGUF reader must reproduce.
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import torch

ARCH = {
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v32": gguf.MODEL_ARCH.DEEPSEEK2,  # its tensor names but the indexer's (the package has no deepseek32)
    "minimax_m2": gguf.MODEL_ARCH.MINIMAXM2,
    "gpt_oss": gguf.MODEL_ARCH.GPT_OSS,
    "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
    "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE,
}
DELTA_NET_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
ARCH_NAMES = {"deepseek_v32": "deepseek32"}  # llama.cpp's names the gguf package lacks
# DeepSeek-V3.2's indexer tensors: Hugging Face module (after self_attn.indexer.) -> GGUF part (after blk.N.)
INDEXER = {
    "wq_b": "indexer.attn_q_b",
    "wk": "indexer.attn_k",
    "k_norm": "indexer.k_norm",
    "weights_proj": "indexer.proj",
}
Q = gguf.GGMLQuantizationType


def write_gguf(model, path, dense: str = "F32", experts: str | None = None, tokenizer: dict | None = None):
    """`model` (a transformers MoE model) as a GGUF file; `dense` / `experts`: the GGML type of the 2-d / expert
    weights (F32, F16, Q8_0, Q4_0, Q6_K). `tokenizer`: metadata keys to add (tokenizer.ggml.*)."""
    config = model.config
    arch = ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(path), ARCH_NAMES.get(config.model_type, gguf.MODEL_ARCH_NAMES[arch]))
    _metadata(writer, config)
    for key, value in (tokenizer or {}).items():
        _add_field(writer, key, value)
    for name, array in tensors(model).items():
        qtype = Q[experts or dense] if "_exps." in name else Q[dense]
        if array.ndim == 1 or name.endswith(".bias") or name.startswith("blk.") and "exp_probs_b" in name:
            qtype = Q.F32
        data = quantize(array, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, in llama.cpp's layout (float32)."""
    config = model.config
    arch = ARCH[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if config.model_type in DELTA_NET_FAMILIES:
            name, array = _delta_net_tensor(name, array, config)
            if name.endswith("in_proj_qkvz.weight"):  # Qwen3-Next's, split as its converter splits it
                out[f"blk.{layer}.attn_qkv.weight"], out[f"blk.{layer}.attn_gate.weight"] = _split_qkvz(array, config)
                continue
        if config.model_type == "gpt_oss" and ".experts." in name:  # [e, d, 2f] / [e, f, d], gate and up interleaved
            kind = name.rsplit(".", 1)[1]
            if kind == "gate_up_proj":
                out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(array[..., 0::2].transpose(0, 2, 1))
                out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(array[..., 1::2].transpose(0, 2, 1))
            elif kind == "gate_up_proj_bias":
                out[f"blk.{layer}.ffn_gate_exps.bias"] = np.ascontiguousarray(array[..., 0::2])
                out[f"blk.{layer}.ffn_up_exps.bias"] = np.ascontiguousarray(array[..., 1::2])
            elif kind == "down_proj":
                out[f"blk.{layer}.ffn_down_exps.weight"] = np.ascontiguousarray(array.transpose(0, 2, 1))
            else:
                out[f"blk.{layer}.ffn_down_exps.bias"] = array
        elif ".self_attn.indexer." in name:
            module, kind = name.split(".self_attn.indexer.")[1].rsplit(".", 1)
            out[f"blk.{layer}.{INDEXER[module]}.{kind}"] = array
        elif name.endswith("self_attn.sinks"):
            out[f"blk.{layer}.attn_sinks.weight"] = array
        elif name.endswith("experts.gate_up_proj"):
            f = array.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = array[:, :f]
            out[f"blk.{layer}.ffn_up_exps.weight"] = array[:, f:]
        elif name.endswith("experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = array
        elif name.endswith("kv_b_proj.weight"):
            heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
            kv_b = array.reshape(heads, nope + v, array.shape[-1])
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        elif name.endswith("shared_expert_gate.weight"):
            out[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = array.reshape(-1)
        else:
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # as the converter does
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"gguf's TensorNameMap has no name for {name}"
            if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                array = _permute(array, heads)
            out[gguf_name] = array
    if config.tie_word_embeddings:
        out.pop("output.weight", None)
    return out


def _delta_net_tensor(name: str, array: np.ndarray, config) -> tuple[str, np.ndarray]:
    """llama.cpp's converter on a Qwen3-Next / Qwen3.5 tensor (conversion/qwen.py): norms stored as 1 + w (not the
    DeltaNet's gated norm), A = -exp(A_log), dt_bias as dt_proj.bias, the convolution squeezed; Qwen3.5's value
    heads tiled."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array + 1.0
    elif name.endswith("A_log"):
        array = -np.exp(array)
    elif name.endswith("dt_bias"):
        name = name.replace("dt_bias", "dt_proj.bias")
    elif name.endswith("conv1d.weight"):
        array = array.squeeze(1)
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if config.model_type == "qwen3_5_moe_text" and ".linear_attn." in name and hk != hv:
        key_dim = hk * config.linear_key_head_dim
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            array = np.concatenate([array[: 2 * key_dim], _tile_value_heads(array[2 * key_dim :], 0, hk, hv // hk)])
        elif name.endswith("out_proj.weight"):
            array = _tile_value_heads(array, 1, hk, hv // hk)
        elif name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_proj.bias")):
            array = _tile_value_heads(array, 0, hk, hv // hk)
    return name, array


def _tile_value_heads(array: np.ndarray, axis: int, key_heads: int, per_key: int) -> np.ndarray:
    """The converter's _reorder_v_heads: grouped by key head [key_heads, per_key, ...] -> tiled [per_key, ...]."""
    moved = np.moveaxis(array, axis, 0)
    grouped = moved.reshape(key_heads, per_key, -1, *moved.shape[1:])
    return np.moveaxis(grouped.swapaxes(0, 1).reshape(moved.shape), 0, axis)


def _split_qkvz(array: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """in_proj_qkvz [key heads x (q, k, values, z), d] -> attn_qkv [q all, k all, values all] and attn_gate [z]."""
    hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    per_key = config.linear_num_value_heads // hk * dv
    grouped = array.reshape(hk, 2 * dk + 2 * per_key, -1)
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + per_key], axis=1)
    d = array.shape[-1]
    qkv = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
    return qkv, np.ascontiguousarray(z.reshape(-1, d))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's `permute` of llama q/k rows (rotate-half -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize(array: np.ndarray, qtype) -> np.ndarray:
    if qtype == Q.Q6_K:
        return quantize_q6_k(array)
    return gguf.quants.quantize(np.ascontiguousarray(array, np.float32), qtype)


def dequantize(array: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(quantize(array, qtype), qtype).reshape(array.shape)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K (per 256 values: 16 int8 sub-block scales, a float16 scale of scales, 6-bit values split into low
    nibbles and high bit pairs), the gguf package having no quantizer for it: the plain rule, not llama.cpp's
    search. Its inverse is the package's dequantizer."""
    rows = w.reshape(-1, 256).astype(np.float32)
    n = rows.shape[0]
    sub = rows.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(axis=-1) / 31
    d = (np.abs(sub_scale).max(axis=-1) / 127).astype(np.float16)
    d32 = np.where(d == 0, 1, d.astype(np.float32))
    scales = np.clip(np.rint(sub_scale / d32[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None, None] * scales[..., None]
    q = np.clip(np.rint(sub / np.where(step == 0, 1, step)), -32, 31).astype(np.int16) + 32
    q = q.reshape(n, 256).astype(np.uint8)
    low, high = (q & 0x0F).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = sum(high[:, :, t] << (2 * t) for t in range(4)).astype(np.uint8).reshape(n, 64)
    blocks = np.concatenate([ql, qh, scales.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)
    return blocks.reshape(*w.shape[:-1], w.shape[-1] // 256 * 210)


def dequantized_model(model, dense: str = "F32", experts: str | None = None):
    """A copy of `model` whose weights are what write_gguf(model, dense=, experts=) stores after quantization."""
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in copy_.named_parameters():
            if p.ndim < 2:
                continue
            qtype = Q[experts or dense] if ".experts." in name else Q[dense]
            array = p.detach().float().numpy()
            if copy_.config.model_type.startswith("deepseek") and name.endswith("kv_b_proj.weight"):
                array = _dequantized_kv_b(array, copy_.config, qtype)
            else:
                array = dequantize(array, qtype)
            p.copy_(torch.from_numpy(array))
    return copy_


def _dequantized_kv_b(array, config, qtype):
    heads, nope = config.num_attention_heads, config.qk_nope_head_dim
    kv_b = array.reshape(heads, -1, array.shape[-1])
    k_b = dequantize(np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), qtype).transpose(0, 2, 1)
    v_b = dequantize(np.ascontiguousarray(kv_b[:, nope:]), qtype)
    return np.concatenate([k_b, v_b], axis=1).reshape(array.shape)


def _metadata(writer, config):
    """What llama.cpp's converter writes for these families (conversion/base.py and the family classes)."""
    t = config.model_type
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1 if t.startswith("deepseek") else config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    writer.add_expert_count(experts or config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "head_dim", None) and not t.startswith("deepseek"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if t in ("mixtral", "olmoe"):
        writer.add_feed_forward_length(config.intermediate_size)
    if t in ("qwen2_moe", "qwen3_moe"):
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if t == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        if config.norm_topk_prob and t == "qwen2_moe":
            writer.add_expert_weights_norm(True)
    if t == "olmoe" and config.clip_qkv:
        writer.add_clamp_kqv(config.clip_qkv)
    if t in ("glm4_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32"):
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        if config.norm_topk_prob:
            writer.add_expert_weights_norm(True)
        if getattr(config, "n_group", None):
            writer.add_expert_group_count(config.n_group)
            writer.add_expert_group_used_count(config.topk_group)
        if t != "deepseek_v2":
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if t == "gpt_oss":
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
        rope = config.rope_parameters
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if t == "minimax_m2":
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_rope_dimension_count(config.rotary_dim)
    if t == "glm4_moe":
        partial = config.rope_parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.5))
        writer.add_rope_dimension_count(int(config.head_dim * partial))
    if t in DELTA_NET_FAMILIES:
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        recurrent = [kind == "linear_attention" for kind in config.layer_types]
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent)
        writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
        writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    if t.startswith("deepseek"):
        if config.q_lora_rank:
            writer.add_q_lora_rank(config.q_lora_rank)
        writer.add_kv_lora_rank(config.kv_lora_rank)
        writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        writer.add_value_length(config.kv_lora_rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
        writer.add_value_length_mla(config.v_head_dim)
        writer.add_rope_dimension_count(config.qk_rope_head_dim)
        _yarn(writer, config)
    if t == "deepseek_v32":
        writer.add_uint32(f"{writer.arch}.attention.indexer.head_count", config.index_n_heads)
        writer.add_uint32(f"{writer.arch}.attention.indexer.key_length", config.index_head_dim)
        writer.add_uint32(f"{writer.arch}.attention.indexer.top_k", config.index_topk)


def _yarn(writer, config):
    rope = config.rope_parameters
    if rope.get("rope_type") != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _add_field(writer, key: str, value):
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: {type(value).__name__}")
