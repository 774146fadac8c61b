"""The bench models as Hugging Face checkpoints with random weights, made once and cached (speed does not depend
on what the weights are). Scripts take `--shape` (`add_shape_argument`) and then read `bench_model_dir()`:

bench           Mixtral-shaped, ~76M parameters: hidden 512, ffn 1408, 4 layers, 8 heads, 2 KV heads, 8 experts
                top-2, vocab 4096 (the shape the first issues measured against transformers)
qwen3-30b-a3b   Qwen3-30B-A3B's real layer dims cut to 2 layers and a 32k vocab: hidden 2048, 128 experts of ffn
                768, top-8, 32 query / 4 KV heads of 128 (~1.2B parameters, stored in bfloat16: 2.4 GB). Each
                expert sees few rows even at prefill (512 tokens x top-8 / 128 experts = 32): the regime the tiny
                model hides.
deepseek-v2-lite
                DeepSeek-V2-Lite's real dims cut to 4 layers (the first dense, as in the model) and a 32k vocab:
                hidden 2048, 64 routed experts of ffn 1408 + 2 shared, top-6, latent attention with kv_lora_rank
                512 and 16 heads of 128 + 64 (no query compression), YaRN rope as released (~1.8B parameters,
                stored in bfloat16: 3.6 GB).
gpt-oss-20b     gpt-oss-20b's real dims cut to 2 layers (one sliding-window, one full) and a 32k vocab: hidden 2880,
                32 experts of ffn 2880 with biases and the clamped SwiGLU, top-4, 64 query / 8 KV heads of 64 with
                sinks, YaRN rope as released (~1.8B parameters, stored in bfloat16: 3.6 GB; its experts as MXFP4
                with `--quant mxfp4`, as the release ships them).
minimax-m2      MiniMax-M2's real dims cut to 1 layer and a 32k vocab: hidden 3072, 256 experts of ffn 1536, top-8
                with sigmoid routing and its correction bias, 48 query / 8 KV heads of 128, q/k norms over the
                whole projections, rotary on 64 of each head's 128 (~3.8B parameters, stored in bfloat16: 7.6 GB).
qwen3-next      Qwen3-Next-80B-A3B's real dims cut to 2 layers (one Gated DeltaNet, one gated full attention) and a
                32k vocab: hidden 2048, 512 experts of ffn 512 + a gated shared expert of 512, top-10, DeltaNet with
                16 key / 32 value heads of 128, attention with 16 query / 2 KV heads of 256, rotary on a quarter of
                each head. The attention layer's MLP is dense (ffn 5120, `mlp_only_layers`): 512 experts a layer are
                1.6B parameters, and a training process holds them twice (the store and its packed copies), so two
                MoE layers would not fit a 24 GB machine (~1.9B parameters, stored in bfloat16: 3.8 GB).
qwen3-next-all-moe
                qwen3-next with both layers' MLPs mixtures of experts, as in the model (llama.cpp's qwen3next has no
                dense MLP layers): for inference only (~3.5B parameters, stored in bfloat16: 7 GB).
qwen3-next-small
                Qwen3-Next's layer pattern at a small size (3 DeltaNet + 1 gated attention layer, hidden 256, 16
                experts top-4, vocab 4096): for what does not depend on size (bench/hybrid_anchors.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

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
QWEN3_30B_A3B_LAYERS = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    max_position_embeddings=4096,
)
DEEPSEEK_V2_LITE_LAYERS = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    topk_method="greedy",
    norm_topk_prob=False,
    max_position_embeddings=163840,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=0.707,
        mscale_all_dim=0.707,
        beta_fast=32,
        beta_slow=1,
    ),
)
GPT_OSS_20B_LAYERS = dict(
    vocab_size=32768,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=2,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)
MINIMAX_M2_LAYERS = dict(
    vocab_size=32768,
    hidden_size=3072,
    intermediate_size=1536,
    num_hidden_layers=1,
    num_attention_heads=48,
    num_key_value_heads=8,
    head_dim=128,
    rotary_dim=64,
    num_local_experts=256,
    num_experts_per_tok=8,
    scoring_func="sigmoid",  # as the release's config says (llama.cpp's converter writes its gating from it)
    max_position_embeddings=196608,
    bos_token_id=None,
    eos_token_id=None,
)
QWEN3_NEXT_80B_LAYERS = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=5120,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    mlp_only_layers=[1],
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512,
    num_experts_per_tok=10,
    norm_topk_prob=True,
    max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
)
QWEN3_NEXT_SMALL = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,  # transformers' default pattern: full attention every 4th layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=4096,
)
# name -> (transformers config class, its settings, dtype the checkpoint is stored in)
SHAPES = {
    "bench": ("MixtralConfig", "MixtralForCausalLM", BENCH_SHAPE, "float32"),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_30B_A3B_LAYERS, "bfloat16"),
    "deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_V2_LITE_LAYERS, "bfloat16"),
    "gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS_20B_LAYERS, "bfloat16"),
    "minimax-m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", MINIMAX_M2_LAYERS, "bfloat16"),
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_NEXT_80B_LAYERS, "bfloat16"),
    "qwen3-next-all-moe": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {k: v for k, v in QWEN3_NEXT_80B_LAYERS.items() if k != "mlp_only_layers"},
        "bfloat16",
    ),
    "qwen3-next-small": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_NEXT_SMALL, "float32"),
}
_selected = "bench"


def add_shape_argument(parser):
    parser.add_argument("--shape", choices=list(SHAPES), default="bench", help="bench model shape (default: bench)")


def use_shape(name: str):
    """Makes `bench_model_dir()` the checkpoint of shape `name` from now on."""
    global _selected
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    _selected = name


def bench_model_dir(shape: str | None = None, layers: int | None = None) -> Path:
    """The checkpoint of `shape` (default: the selected one), made on first use; `layers`: with that many
    layers instead of the shape's own."""
    shape = shape or _selected
    path = Path(tempfile.gettempdir()) / ("moe_jax_bench_mixtral" if shape == "bench" else f"moe_jax_bench_{shape}")
    if layers is not None:
        path = path.with_name(f"{path.name}_{layers}layers")
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    config_class, model_class, settings, dtype = SHAPES[shape]
    if layers is not None:
        settings = {**settings, "num_hidden_layers": layers}
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**settings)
    with torch.device("cpu"):
        model = getattr(transformers, model_class)(config).to(getattr(torch, dtype))
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(partial)
    partial.rename(path)  # whole or not at all: an interrupted save is not mistaken for a model
    return path


def mxfp4_release_dir(shape: str | None = None) -> Path:
    """The GPT-OSS checkpoint of `shape` laid out as openai/gpt-oss-* ship: its experts as MXFP4 blocks and scales
    (ggml's rounding), the rest as stored, `quantization_config` mxfp4; made on first use beside it."""
    import json

    from moe_jax.formats.mxfp4 import RELEASE_QUANTIZATION_CONFIG, release_blocks
    from moe_jax.formats.safetensors_io import TensorSource, save_safetensors

    source = bench_model_dir(shape)
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "gpt_oss":
        raise ValueError(f"{source}: an MXFP4 release is made of a GPT-OSS shape, not {config.get('model_type')}")
    path = source.with_name(source.name + "_mxfp4")
    if (path / "config.json").exists():
        return path
    partial = path.with_name(path.name + ".partial")
    partial.mkdir(exist_ok=True)
    tensors = TensorSource.open(source)
    out = {}
    for name in tensors.names():
        w = tensors.get(name)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [e, in, out] in transformers' layout
            # an expert at a time: the quantizer's temporaries for a whole layer's experts would not fit 24 GB
            parts = [release_blocks(np.swapaxes(e.astype(np.float32), -1, -2)) for e in w]
            out[name + "_blocks"], out[name + "_scales"] = (np.stack(p) for p in zip(*parts, strict=True))
        else:
            out[name] = w
    save_safetensors(partial / "model.safetensors", out)
    config["quantization_config"] = RELEASE_QUANTIZATION_CONFIG
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    if (source / "generation_config.json").exists():
        (partial / "generation_config.json").write_bytes((source / "generation_config.json").read_bytes())
    partial.rename(path)
    return path


def random_adapter(model_dir, out: Path, seed: int, targets: tuple[str, ...], rank: int) -> Path:
    """A LoRA adapter on `model_dir` with random A and B (not peft's zero B), so every output it touches changes,
    exported to `out` as a training run does; for per-request adapters' tests and benchmarks."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moe_jax
    from moe_jax.formats.adapters import export_peft
    from moe_jax.model.lora import LoRAConfig, split_trainable

    model = moe_jax.load_model(model_dir)
    model.attach_lora(LoRAConfig(rank=rank, alpha=2.0 * rank, targets=targets), seed=seed)
    _, lora, _ = split_trainable(model.transformer)
    rng = np.random.default_rng(seed)
    model.set_lora_state(jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), lora))
    export_peft(model.transformer, model.lora_config, out, str(model_dir))
    return out
