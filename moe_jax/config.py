"""Model configuration: one plain dataclass for every supported MoE architecture.

Architectures differ only in a handful of switches (shared expert, q/k norm, top-k renormalisation, attention
biases), so one config and one module tree cover Mixtral, Qwen2-MoE and Qwen3-MoE. DeepSeek-style layers will add
switches (attention kind, grouped routing) rather than a second model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe_jax.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


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
    num_experts_per_tok: int
    expert_intermediate_size: int
    # Width of the dense MLP used by layers that have no experts (Qwen `mlp_only_layers`, DeepSeek's first layers).
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(x @ w_gate) scales the shared expert
    norm_topk_prob: bool = True
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
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

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` dictionary."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key):
            if key not in hf:
                raise ConfigError(f"{source}: missing key {key!r} for model_type {model_type!r}")
            return hf[key]

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope = hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported yet (only 'default')")
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))

        # transformers 5 writes `num_local_experts` for every family; older Qwen configs say `num_experts`.
        num_experts = int(hf["num_local_experts"] if "num_local_experts" in hf else need("num_experts"))
        if model_type == "mixtral":
            expert_ffn = int(need("intermediate_size"))
            dense_ffn, dense_layers = 0, ()
            shared_ffn, norm_topk = 0, True
            window = hf.get("sliding_window")
            windows = (int(window) if window else None,) * num_layers
        else:
            expert_ffn = int(need("moe_intermediate_size"))
            dense_ffn = int(hf.get("intermediate_size") or 0)
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(hf.get("mlp_only_layers") or [])
            dense_layers = tuple(
                i for i in range(num_layers) if i in mlp_only or num_experts == 0 or (i + 1) % step != 0
            )
            shared_ffn = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
            norm_topk = bool(hf.get("norm_topk_prob", False))
            windows = _qwen_windows(hf, num_layers)

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            num_experts=num_experts,
            num_experts_per_tok=int(need("num_experts_per_tok")),
            expert_intermediate_size=expert_ffn,
            dense_intermediate_size=dense_ffn,
            shared_expert_intermediate_size=shared_ffn,
            shared_expert_gated=shared_ffn > 0,
            norm_topk_prob=norm_topk,
            qk_norm=model_type == "qwen3_moe",
            # Older Qwen2-MoE configs have no `qkv_bias` key but always carry q/k/v biases.
            qkv_bias=bool(hf.get("qkv_bias", model_type == "qwen2_moe") or hf.get("attention_bias", False)),
            o_bias=bool(hf.get("attention_bias", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            sliding_windows=windows,
            dense_layers=dense_layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_config=dict(hf),
        )


def _qwen_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    max_window_layers = int(hf.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= max_window_layers else None for i in range(num_layers))
