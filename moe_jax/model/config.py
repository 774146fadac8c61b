"""Model configuration: one plain dataclass for every supported MoE architecture.

Architectures differ in a handful of switches (attention kind, shared experts, q/k norm, the router's scoring and
grouping, biases, rotary layout), so one config and one module tree cover Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
GLM-4.5, DeepSeek-V2/V3/V3.2, MiniMax-M2, GPT-OSS, Qwen3-Next and Qwen3.5-MoE. Reading a Hugging Face `config.json`
into it is `moe_jax.formats.hf_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from host_kernels import GLU, SWIGLU
from moe_jax.errors import ConfigError
from moe_jax.model.rope import Rope

SUPPORTED_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "minimax_m2",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe",
)
MAX_LAYERS = 4096  # far beyond any real model; a config claiming more would size per-layer tuples forever


@dataclass(frozen=True)
class Router:
    """How a token picks its experts (transformers' TopKRouter of each family).

    scores: softmax or sigmoid of the router logits; `bias` (DeepSeek-V3's e_score_correction_bias) shifts the
    scores used to choose, not the weights. With groups > 1 the experts are split in `groups` equal groups, each
    scored by its best expert (`group_score` "max") or best two ("top2"), and only the `topk_groups` best groups
    are eligible. The chosen scores are optionally renormalised, then multiplied by `scale`.
    """

    top_k: int
    scores: str = "softmax"  # or "sigmoid", or "topk_softmax" (GPT-OSS: the top k logits, then a softmax over them)
    norm_topk_prob: bool = True
    bias: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scale: float = 1.0
    float32_logits: bool = False  # DeepSeek / GLM: logits from float32 inputs (others: the model's dtype)
    logit_bias: bool = False  # GPT-OSS: the router is a Linear with a bias (added to the logits)


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): `num_heads` small query heads of `head_dim`
    score every earlier token through one key of `head_dim` per token, and each query attends to its `top_k`
    best-scored tokens only (all of them while a sequence is shorter than that)."""

    num_heads: int
    head_dim: int
    top_k: int


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank `q_lora_rank` (0: one
    projection), keys and values from a shared `kv_lora_rank` latent plus one rotary key of `rope_dim` per token;
    with an `indexer` (DeepSeek-V3.2), sparse over the tokens it selects."""

    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int  # query/key dimensions without rotary
    rope_dim: int
    v_dim: int
    indexer: SparseIndexer | None = None

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (Qwen3-Next's linear attention): `num_k_heads` query/key heads of `k_head_dim`, each serving
    `num_v_heads / num_k_heads` value heads of `v_head_dim`, after a causal depthwise convolution of `conv_kernel`
    taps. Its generation state per sequence is fixed-size: the last `conv_kernel - 1` convolution inputs and a
    [k_head_dim, v_head_dim] matrix per value head."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # Qwen3-Next: queries, keys, values and z in one projection, beta and a in another, grouped per key head;
    # Qwen3.5: four projections, each in plain head order
    fused_projections: bool = True

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    router: Router
    expert_intermediate_size: int
    rope: Rope
    mla: MLA | None = None  # set: multi-head latent attention instead of grouped-query attention
    # Width of the dense MLP used by layers that have no experts (Qwen `mlp_only_layers`, DeepSeek's first layers).
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(x @ w_gate) scales the shared expert
    # "" none, "head" one RMSNorm per head (Qwen3, GLM), "full" over all heads' projection at once (OLMoE)
    qk_norm: str = ""
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip]
    qkv_bias: bool = False
    o_bias: bool = False
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax's denominator
    attention_output_gate: bool = False  # Qwen3-Next: q_proj also gives a gate; attention out *= sigmoid(gate)
    # Qwen3-Next: the layers in `linear_layers` mix tokens with Gated DeltaNet instead of attention
    linear_attention: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()
    norm_unit_offset: bool = False  # Qwen3-Next: RMSNorm weights are stored as w - 1 (the norm scales by 1 + w)
    # What each routed expert computes between its projections (GPT-OSS: a clamped SwiGLU), and whether its gate/up
    # and down projections carry biases (GPT-OSS)
    expert_glu: GLU = SWIGLU
    expert_bias: bool = False
    rms_norm_eps: float = 1e-6
    softmax_scale: float = 0.0  # 0: 1 / sqrt(query head dim)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # Per-layer sliding window (None: full causal attention).
    sliding_windows: tuple[int | None, ...] = ()
    # Indices of layers whose MLP is dense instead of a mixture of experts.
    dense_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(f"{len(self.sliding_windows)} sliding windows given for {self.num_layers} layers")
        if self.linear_layers and (self.linear_attention is None or max(self.linear_layers) >= self.num_layers):
            raise ConfigError(f"linear-attention layers {self.linear_layers} need a LinearAttention and layer indices")
        if not self.softmax_scale:
            query_dim = self.mla.qk_dim if self.mla else self.head_dim
            object.__setattr__(self, "softmax_scale", query_dim**-0.5)

    @property
    def num_experts_per_tok(self) -> int:
        return self.router.top_k

    @property
    def norm_topk_prob(self) -> bool:
        return self.router.norm_topk_prob

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def is_linear_layer(self, layer: int) -> bool:
        return layer in self.linear_layers

    @property
    def kv_cache_dims(self) -> tuple[tuple[int, int], ...]:
        """(heads, dim) of the arrays each attention layer caches per token: keys and values, or with MLA the
        compressed latent and the rotary key (one "head" each: what the DeepSeek papers cache, not the expanded
        heads), and with a sparse indexer its key too."""
        if self.mla is not None:
            indexer = self.mla.indexer
            return ((1, self.mla.kv_lora_rank), (1, self.mla.rope_dim)) + (
                ((1, indexer.head_dim),) if indexer is not None else ()
            )
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
