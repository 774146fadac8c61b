"""Model configuration: one plain dataclass for every supported MoE architecture.

Architectures differ only in a handful of switches (shared expert, q/k norm, top-k renormalisation, attention
biases), so one config and one module tree cover Mixtral, Qwen2-MoE and Qwen3-MoE. DeepSeek-style layers will add
switches (attention kind, grouped routing) rather than a second model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe_jax.errors import ConfigError, is_finite_number, is_int

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
MAX_LAYERS = 4096  # far beyond any real model; a config claiming more would size per-layer tuples forever


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
        """Builds the config from a Hugging Face `config.json` dictionary, every value type- and range-checked
        (a ConfigError names the key and value: a model built from nonsense would compute nonsense silently)."""
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        read = _Fields(hf, source, model_type)
        num_layers = read.int("num_hidden_layers")
        if num_layers > MAX_LAYERS:
            raise ConfigError(
                f"{source}: num_hidden_layers = {num_layers} is beyond any real model (at most {MAX_LAYERS})"
            )
        num_heads = read.int("num_attention_heads")
        hidden = read.int("hidden_size")
        if hf.get("head_dim") is None and hidden % num_heads:
            raise ConfigError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={num_heads}")
        head_dim = read.int("head_dim", hidden // num_heads)
        rope = read.object("rope_parameters")
        rope_scaling = read.object("rope_scaling")
        rope_type = rope.get("rope_type", rope_scaling.get("rope_type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported yet (only 'default')")
        rope_theta = _Fields(rope, f"{source} rope_parameters", model_type).positive(
            "rope_theta", read.positive("rope_theta", 10000.0)
        )

        # transformers 5 writes `num_local_experts` for every family; older Qwen configs say `num_experts`.
        num_experts = read.int("num_local_experts" if "num_local_experts" in hf else "num_experts")
        if model_type == "mixtral":
            expert_ffn = read.int("intermediate_size")
            dense_ffn, dense_layers = 0, ()
            shared_ffn, norm_topk = 0, True
            windows = (read.window(),) * num_layers
        else:
            expert_ffn = read.int("moe_intermediate_size")
            dense_ffn = read.int("intermediate_size", 0, minimum=0)
            step = read.int("decoder_sparse_step", 1)
            mlp_only = set(read.layer_list("mlp_only_layers", num_layers))
            dense_layers = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
            if dense_layers and dense_ffn == 0:
                raise ConfigError(f"{source}: layers {list(dense_layers)} are dense but intermediate_size is 0")
            shared_ffn = read.int("shared_expert_intermediate_size", 0, minimum=0) if model_type == "qwen2_moe" else 0
            norm_topk = read.bool("norm_topk_prob", False)
            windows = _qwen_windows(read, num_layers)

        return cls(
            model_type=model_type,
            vocab_size=read.int("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=read.int("num_key_value_heads", num_heads),
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=read.int("num_experts_per_tok"),
            expert_intermediate_size=expert_ffn,
            dense_intermediate_size=dense_ffn,
            shared_expert_intermediate_size=shared_ffn,
            shared_expert_gated=shared_ffn > 0,
            norm_topk_prob=norm_topk,
            qk_norm=model_type == "qwen3_moe",
            # Older Qwen2-MoE configs have no `qkv_bias` key but always carry q/k/v biases.
            qkv_bias=read.bool("qkv_bias", model_type == "qwen2_moe") or read.bool("attention_bias", False),
            o_bias=read.bool("attention_bias", False),
            rms_norm_eps=read.positive("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            tie_word_embeddings=read.bool("tie_word_embeddings", False),
            max_position_embeddings=read.int("max_position_embeddings", 4096),
            sliding_windows=windows,
            dense_layers=dense_layers,
            bos_token_id=read.token_ids("bos_token_id")[0] if read.token_ids("bos_token_id") else None,
            eos_token_ids=read.token_ids("eos_token_id"),
            hf_config=dict(hf),
        )


_MISSING = object()


class _Fields:
    """Typed, range-checked reads of a config dictionary; every failure is a ConfigError naming key and value.
    A key that is absent or null takes the default (as transformers does); without a default it is required."""

    def __init__(self, hf: dict, source: str, model_type):
        self.hf, self.source, self.model_type = hf, source, model_type

    def _get(self, key, default):
        value = self.hf.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.source}: missing key {key!r} for model_type {self.model_type!r}")
            return default
        return value

    def _bad(self, key, value, want: str):
        return ConfigError(f"{self.source}: {key} = {value!r} must be {want}")

    def int(self, key, default=_MISSING, minimum: int = 1) -> int:
        value = self._get(key, default)
        # JSON writers may spell a whole number as 2.0; anything else fractional is a mistake, not a truncation.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not is_int(value) or value < minimum:
            raise self._bad(key, value, f"an integer >= {minimum}")
        return value

    def positive(self, key, default=_MISSING) -> float:
        value = self._get(key, default)
        if not is_finite_number(value) or value <= 0:
            raise self._bad(key, value, "a finite number > 0")
        return float(value)

    def bool(self, key, default) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def object(self, key) -> dict:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self._bad(key, value, "an object")
        return value

    def window(self) -> int | None:
        """The sliding window: absent, null, 0 or false mean full attention."""
        value = self.hf.get("sliding_window")
        return None if value in (None, 0, False) else self.int("sliding_window")

    def layer_list(self, key, num_layers: int) -> list[int]:
        value = self._get(key, [])
        if not isinstance(value, list) or not all(is_int(i) and 0 <= i < num_layers for i in value):
            raise self._bad(key, value, f"a list of layer indices in [0, {num_layers})")
        return value

    def token_ids(self, key) -> tuple[int, ...]:
        value = self._get(key, [])
        ids = value if isinstance(value, list) else [value]
        if not all(is_int(i) and i >= 0 for i in ids):
            raise self._bad(key, value, "a token id or a list of token ids")
        return tuple(ids)


def _qwen_windows(read: _Fields, num_layers: int) -> tuple[int | None, ...]:
    window = read.window()
    if not read.bool("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    layer_types = read.hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise read._bad("layer_types", layer_types, f"a list of {num_layers} layer types")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    max_window_layers = read.int("max_window_layers", num_layers, minimum=0)
    return tuple(window if i >= max_window_layers else None for i in range(num_layers))
