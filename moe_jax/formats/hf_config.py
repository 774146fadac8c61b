"""Reading a Hugging Face `config.json` into a ModelConfig, one reader per family, every value type- and
range-checked: a ConfigError names the file, key and value (a model built from nonsense would compute nonsense
silently). Defaults are transformers' own for each family, so a config that omits a key means what it means there.
"""

from __future__ import annotations

from host_kernels import GLU
from moe_jax.errors import ConfigError, is_finite_number, is_int
from moe_jax.formats import hf_names
from moe_jax.model.config import (
    MAX_LAYERS,
    MLA,
    SUPPORTED_MODEL_TYPES,
    LinearAttention,
    ModelConfig,
    Router,
    SparseIndexer,
)
from moe_jax.model.rope import KINDS, Rope, yarn_mscale

# model types that are a supported architecture under another name: Kimi-K2's config says "kimi_k2" and
# DeepseekV3ForCausalLM (its remote code is DeepSeek-V3's)
# Qwen3.5-MoE's text-only checkpoints say "qwen3_5_moe_text" (its multimodal ones nest that config in `text_config`)
ALIASES = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe"}


def language_model_config(hf: dict) -> dict:
    """The part of a config.json that describes the language model: a multimodal release's `text_config` (under the
    family's own model type, with the release's head tying), else the config itself."""
    multimodal = (
        isinstance(hf, dict) and isinstance(hf.get("model_type"), str) and hf["model_type"] in hf_names.LANGUAGE_MODEL
    )
    if not multimodal or not isinstance(hf.get("text_config"), dict):
        return hf
    text = {**hf["text_config"], "model_type": hf["model_type"]}
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def read_hf_config(hf: dict, source: str = "config.json") -> ModelConfig:
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    whole, hf = hf, language_model_config(hf)
    model_type = hf.get("model_type")
    model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    read = _Fields(hf, source, model_type)
    num_layers = read.int("num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise ConfigError(f"{source}: num_hidden_layers = {num_layers} is beyond any real model (at most {MAX_LAYERS})")
    num_heads = read.int("num_attention_heads")
    hidden = read.int("hidden_size")
    common = dict(
        model_type=model_type,
        vocab_size=read.int("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=read.int("num_key_value_heads", num_heads),
        rms_norm_eps=read.positive("rms_norm_eps", 1e-6),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        max_position_embeddings=read.int("max_position_embeddings", 4096),
        bos_token_id=read.token_ids("bos_token_id")[0] if read.token_ids("bos_token_id") else None,
        eos_token_ids=read.token_ids("eos_token_id"),
        hf_config=dict(whole),
    )
    family = _FAMILIES[model_type](read, num_layers)
    return ModelConfig(**common, **family)


def _head_dim(read: _Fields) -> int:
    hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
    if read.hf.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{read.source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    return read.int("head_dim", hidden // heads)


def _num_experts(read: _Fields) -> int:
    # transformers 5 writes `num_local_experts` for Mixtral, older Qwen configs `num_experts`, DeepSeek and GLM
    # `n_routed_experts`
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if read.hf.get(key) is not None:
            return read.int(key)
    return read.int("num_experts")  # raises, naming the usual key


def _mixtral(read: _Fields, num_layers: int) -> dict:
    head_dim = _head_dim(read)
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=Router(top_k=read.int("num_experts_per_tok")),
        expert_intermediate_size=read.int("intermediate_size"),
        rope=_rope(read, head_dim),
        sliding_windows=(read.window(),) * num_layers,
    )


def _qwen_dense_layers(read: _Fields, num_layers: int) -> tuple[int, ...]:
    """Qwen's dense layers: those in `mlp_only_layers`, and all but every `decoder_sparse_step`-th."""
    step = read.int("decoder_sparse_step", 1)
    mlp_only = set(read.layer_list("mlp_only_layers", num_layers))
    return tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)


def _qwen(read: _Fields, num_layers: int) -> dict:
    head_dim = _head_dim(read)
    dense_ffn = read.int("intermediate_size", 0, minimum=0)
    dense_layers = _qwen_dense_layers(read, num_layers)
    qwen2 = read.model_type == "qwen2_moe"
    shared_ffn = read.int("shared_expert_intermediate_size", 0, minimum=0) if qwen2 else 0
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=Router(top_k=read.int("num_experts_per_tok"), norm_topk_prob=read.bool("norm_topk_prob", False)),
        expert_intermediate_size=read.int("moe_intermediate_size"),
        rope=_rope(read, head_dim),
        dense_intermediate_size=_dense_width(read, dense_layers, dense_ffn),
        dense_layers=dense_layers,
        shared_expert_intermediate_size=shared_ffn,
        shared_expert_gated=shared_ffn > 0,
        qk_norm="" if qwen2 else "head",
        # Older Qwen2-MoE configs have no `qkv_bias` key but always carry q/k/v biases.
        qkv_bias=read.bool("qkv_bias", qwen2) or read.bool("attention_bias", False),
        o_bias=read.bool("attention_bias", False),
        sliding_windows=_qwen_windows(read, num_layers),
    )


def _olmoe(read: _Fields, num_layers: int) -> dict:
    head_dim = _head_dim(read)
    clip = read.hf.get("clip_qkv")
    bias = read.bool("attention_bias", False)
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=Router(top_k=read.int("num_experts_per_tok"), norm_topk_prob=read.bool("norm_topk_prob", False)),
        expert_intermediate_size=read.int("intermediate_size"),
        rope=_rope(read, head_dim),
        qk_norm="full",
        clip_qkv=None if clip is None else read.positive("clip_qkv"),
        qkv_bias=bias,
        o_bias=bias,
    )


def _glm4_moe(read: _Fields, num_layers: int) -> dict:
    head_dim = _head_dim(read)
    moe_ffn = read.int("moe_intermediate_size")
    dense_layers = _first_dense(read, num_layers)
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=_grouped_sigmoid_router(read),
        expert_intermediate_size=moe_ffn,
        rope=_rope(read, head_dim, partial_default=0.5),
        dense_intermediate_size=_dense_width(read, dense_layers, read.int("intermediate_size", 0, minimum=0)),
        dense_layers=dense_layers,
        shared_expert_intermediate_size=moe_ffn * read.int("n_shared_experts", 1, minimum=0),
        qk_norm="head" if read.bool("use_qk_norm", False) else "",
        qkv_bias=read.bool("attention_bias", False),
    )


def _deepseek(read: _Fields, num_layers: int) -> dict:
    v3 = read.model_type in ("deepseek_v3", "deepseek_v32")
    v32 = read.model_type == "deepseek_v32"
    q_lora_rank = read.int("q_lora_rank", 0 if not v3 else 1536, minimum=1 if v32 else 0)
    rope_dim = read.int("qk_rope_head_dim", 64)
    mla = MLA(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=read.int("kv_lora_rank", 512),
        nope_dim=read.int("qk_nope_head_dim", 128),
        rope_dim=rope_dim,
        v_dim=read.int("v_head_dim", 128),
        indexer=_sparse_indexer(read, rope_dim, num_layers) if v32 else None,
    )
    if mla.rope_dim % 2:
        raise read.bad("qk_rope_head_dim", mla.rope_dim, "even (rotary dimensions come in pairs)")
    # DeepSeek-V2 and V3.2 rotate interleaved pairs always (complex multiplication); V3 unless rope_interleave is false
    interleave = read.bool("rope_interleave", True) if v3 and not v32 else True
    rope = _rope(read, mla.rope_dim, interleave=interleave)
    scale = mla.qk_dim**-0.5
    params = _rope_params(read)
    if rope.kind != "default" and params.get("mscale_all_dim"):  # DeepSeek's YaRN also sharpens the softmax
        scale *= yarn_mscale(rope.factor, float(params["mscale_all_dim"])) ** 2
    moe_ffn = read.int("moe_intermediate_size", 1407)
    if v3:
        router = _grouped_sigmoid_router(read, default_groups=(8, 4))  # transformers' defaults for both
    else:
        method = read.choice("topk_method", ("greedy", "group_limited_greedy"), "greedy")
        groups, topk_groups = _groups(read, required=True) if method == "group_limited_greedy" else (1, 1)
        router = Router(
            top_k=read.int("num_experts_per_tok"),
            # transformers' DeepSeek-V2 router never renormalises (V2 configs say norm_topk_prob: false)
            norm_topk_prob=False,
            groups=groups,
            topk_groups=topk_groups,
            scale=read.positive("routed_scaling_factor", 1.0),
            float32_logits=True,
        )
    dense_layers = _v32_dense_layers(read, num_layers) if v32 else _first_dense(read, num_layers, 3 if v3 else 0)
    return dict(
        head_dim=mla.qk_dim,
        num_experts=_num_experts(read),
        router=router,
        expert_intermediate_size=moe_ffn,
        rope=rope,
        mla=mla,
        dense_intermediate_size=_dense_width(read, dense_layers, read.int("intermediate_size", 0, minimum=0)),
        dense_layers=dense_layers,
        shared_expert_intermediate_size=moe_ffn * read.int("n_shared_experts", 2 if not v3 else 1, minimum=0),
        qkv_bias=read.bool("attention_bias", False),  # on q_a_proj / kv_a_proj_with_mqa (MLA's input side)
        o_bias=read.bool("attention_bias", False),
        softmax_scale=scale,
    )


def _sparse_indexer(read: _Fields, rope_dim: int, num_layers: int) -> SparseIndexer:
    """DeepSeek-V3.2's lightning indexer, on every layer (transformers' only layer type for it)."""
    read.layer_types(("indexed_attention",), ["indexed_attention"] * num_layers)
    head_dim = read.int("index_head_dim", 128)
    if head_dim < rope_dim:
        raise read.bad("index_head_dim", head_dim, f"at least qk_rope_head_dim = {rope_dim} (its rotary part)")
    return SparseIndexer(num_heads=read.int("index_n_heads", 64), head_dim=head_dim, top_k=read.int("index_topk", 2048))


def _v32_dense_layers(read: _Fields, num_layers: int) -> tuple[int, ...]:
    """DeepSeek-V3.2: `mlp_layer_types` ("dense" or "sparse" per layer), else the first `first_k_dense_replace`."""
    first = min(read.int("first_k_dense_replace", 3, minimum=0), num_layers)
    default = ["dense"] * first + ["sparse"] * (num_layers - first)
    kinds = read.layer_types(("dense", "sparse"), default, key="mlp_layer_types")
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def _minimax_m2(read: _Fields, num_layers: int) -> dict:
    """MiniMax-M2: Mixtral's layout with sigmoid routing (a correction bias for the choice, the chosen weights
    renormalised), q/k RMSNorm over each whole projection, and rotary on the first `rotary_dim` of each head."""
    head_dim = _head_dim(read)
    # The released configs carry MiniMax's own switches beside transformers' keys; transformers implements one
    # setting of each, so any other is refused rather than computed as something it is not.
    read.choice("scoring_func", ("sigmoid",), "sigmoid")
    read.choice("qk_norm_type", ("per_layer",), "per_layer")
    for key in ("use_qk_norm", "use_routing_bias"):
        if not read.bool(key, True):
            raise read.bad(key, False, "true (transformers' MiniMax-M2 always has it)")
    if read.int("shared_intermediate_size", 0, minimum=0):
        raise read.bad("shared_intermediate_size", read.hf["shared_intermediate_size"], "0 (no shared expert)")
    rotary_dim = read.int("rotary_dim", head_dim)
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=Router(top_k=read.int("num_experts_per_tok"), scores="sigmoid", norm_topk_prob=True, bias=True),
        expert_intermediate_size=read.int("intermediate_size"),
        rope=_rope(read, head_dim, partial_default=rotary_dim / head_dim, theta_default=5e6),
        qk_norm="full",
    )


# transformers' GPT-OSS rotary where a config names none (every release writes this one)
GPT_OSS_ROPE = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
)


def _gpt_oss(read: _Fields, num_layers: int) -> dict:
    """GPT-OSS: attention with biases and a learned sink logit per head, sliding-window and full layers as
    `layer_types` says (transformers' default: alternating, sliding first), a router with a bias whose top-k logits
    are softmaxed, experts with biases and a clamped SwiGLU, YaRN rotary over the whole head."""
    head_dim = _head_dim(read)
    bias = read.bool("attention_bias", True)
    window = read.window()
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    layer_types = read.layer_types(("sliding_attention", "full_attention"), alternating)
    if window is None and "sliding_attention" in layer_types:
        raise read.bad("sliding_window", read.hf.get("sliding_window"), "a window size for the sliding layers")
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=Router(top_k=read.int("num_experts_per_tok"), scores="topk_softmax", logit_bias=True),
        expert_intermediate_size=read.int("intermediate_size"),
        rope=_rope(read, head_dim, theta_default=150000.0, params_default=GPT_OSS_ROPE),
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        expert_glu=GLU(
            "clamped_swiglu", alpha=read.positive("swiglu_alpha", 1.702), limit=read.positive("swiglu_limit", 7.0)
        ),
        expert_bias=True,
    )


def _qwen3_next(read: _Fields, num_layers: int) -> dict:
    """Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet layers and gated full-attention layers (`layer_types`; by default
    every `full_attention_interval`-th is full), Qwen's experts with a gated shared expert, q/k RMSNorm per head,
    rotary on a quarter of each head, RMSNorm weights stored as w - 1. Qwen3.5 projects the DeltaNet's inputs
    apart (in_proj_qkv, _z, _b, _a) where Qwen3-Next fuses them per key head, and always renormalises the top-k
    weights. (Qwen3.5's multimodal rotary sections coincide with the plain rotary for text: every position is a
    text position.)"""
    qwen3_5 = read.model_type == "qwen3_5_moe"
    head_dim = read.int("head_dim", 256)
    read.choice("hidden_act", ("silu",), "silu")
    interval = read.int("full_attention_interval", 4)
    by_interval = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    layer_types = read.layer_types(("linear_attention", "full_attention"), by_interval)
    linear = LinearAttention(
        num_k_heads=read.int("linear_num_key_heads", 16),
        num_v_heads=read.int("linear_num_value_heads", 32),
        k_head_dim=read.int("linear_key_head_dim", 128),
        v_head_dim=read.int("linear_value_head_dim", 128),
        conv_kernel=read.int("linear_conv_kernel_dim", 4),
        fused_projections=not qwen3_5,
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise read.bad("linear_num_value_heads", linear.num_v_heads, "a multiple of linear_num_key_heads")
    dense_layers = _qwen_dense_layers(read, num_layers)
    bias = read.bool("attention_bias", False)
    shared = read.int("shared_expert_intermediate_size", 512)
    return dict(
        head_dim=head_dim,
        num_experts=_num_experts(read),
        router=Router(
            top_k=read.int("num_experts_per_tok"), norm_topk_prob=qwen3_5 or read.bool("norm_topk_prob", True)
        ),
        expert_intermediate_size=read.int("moe_intermediate_size", 512),
        rope=_rope(read, head_dim, partial_default=0.25),
        dense_intermediate_size=_dense_width(read, dense_layers, read.int("intermediate_size", 5632, minimum=0)),
        dense_layers=dense_layers,
        shared_expert_intermediate_size=shared,
        shared_expert_gated=True,
        qk_norm="head",
        qkv_bias=bias,
        o_bias=bias,
        attention_output_gate=True,
        linear_attention=linear,
        linear_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
        norm_unit_offset=True,
    )


_FAMILIES = {
    "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
    "minimax_m2": _minimax_m2,
    "qwen2_moe": _qwen,
    "qwen3_moe": _qwen,
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe": _qwen3_next,
    "olmoe": _olmoe,
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek,
}


def _groups(read: _Fields, required: bool = False, defaults: tuple[int, int] = (1, 1)) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router, checked against the expert count."""
    num_experts, groups = _num_experts(read), read.int("n_group", _MISSING if required else defaults[0])
    if num_experts % groups:
        raise read.bad("n_group", groups, f"a divisor of the {num_experts} routed experts")
    topk_groups = read.int("topk_group", _MISSING if required else defaults[1])
    if topk_groups > groups:
        raise read.bad("topk_group", topk_groups, f"at most n_group = {groups}")
    return groups, topk_groups


def _grouped_sigmoid_router(read: _Fields, default_groups: tuple[int, int] = (1, 1)) -> Router:
    """DeepSeek-V3 / GLM-4.5: sigmoid scores, correction bias for the choice, groups scored by their best two."""
    groups, topk_groups = _groups(read, defaults=default_groups)
    return Router(
        top_k=read.int("num_experts_per_tok"),
        scores="sigmoid",
        norm_topk_prob=read.bool("norm_topk_prob", True),
        bias=True,
        groups=groups,
        topk_groups=topk_groups,
        group_score="top2",
        scale=read.positive("routed_scaling_factor", 1.0),
        float32_logits=True,
    )


def _first_dense(read: _Fields, num_layers: int, default_first: int = 0) -> tuple[int, ...]:
    """DeepSeek / GLM: the first `first_k_dense_replace` layers are dense, and of the rest every
    `moe_layer_freq`-th (DeepSeek's own code; transformers' ignores the key, which every released config sets 1)."""
    first = read.int("first_k_dense_replace", default_first, minimum=0)
    freq = read.int("moe_layer_freq", 1)
    return tuple(i for i in range(num_layers) if i < first or i % freq != 0)


def _dense_width(read: _Fields, dense_layers, width: int) -> int:
    if dense_layers and width == 0:
        raise ConfigError(f"{read.source}: layers {list(dense_layers)} are dense but intermediate_size is 0")
    return width


def _rope_params(read: _Fields) -> dict:
    """transformers 5 writes `rope_parameters`; older configs `rope_scaling` (with `type`) beside `rope_theta`."""
    return read.object("rope_parameters") or read.object("rope_scaling")


def _rope(
    read: _Fields,
    head_dim: int,
    interleave: bool = False,
    partial_default: float = 1.0,
    theta_default: float = 10000.0,
    params_default: dict | None = None,
) -> Rope:
    """The rotary embedding as transformers computes it for this family; `*_default`: the family's defaults where
    the config leaves them out."""
    params = _rope_params(read) or params_default or {}
    where = f"{read.source} {'rope_parameters' if read.hf.get('rope_parameters') else 'rope_scaling'}"
    p = _Fields(params, where, read.model_type)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in KINDS:
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported; supported: {', '.join(KINDS)}")
    theta = p.positive("rope_theta", read.positive("rope_theta", theta_default))
    partial = p.positive("partial_rotary_factor", read.positive("partial_rotary_factor", partial_default))
    dim = int(head_dim * partial)
    if dim < 2 or dim % 2 or partial > 1:
        raise p.bad("partial_rotary_factor", partial, f"a fraction of head_dim {head_dim} giving an even width")
    max_positions = read.int("max_position_embeddings", 4096)
    fields = dict(dim=dim, theta=theta, kind=kind, max_positions=max_positions, interleave=interleave)
    if kind == "default":
        return Rope(**fields)
    original = p.int("original_max_position_embeddings", max_positions)
    if kind == "yarn":
        factor = p.positive("factor", max_positions / original)
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            default_attention = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
        else:
            default_attention = yarn_mscale(factor)
        return Rope(
            **fields,
            factor=factor,
            original_max_positions=original,
            attention_factor=p.positive("attention_factor", default_attention),
            beta_fast=p.positive("beta_fast", 32.0),
            beta_slow=p.positive("beta_slow", 1.0),
            truncate=p.bool("truncate", True),
        )
    factor = p.positive("factor")
    if kind == "llama3":
        return Rope(
            **fields,
            factor=factor,
            original_max_positions=original,
            low_freq_factor=p.positive("low_freq_factor"),
            high_freq_factor=p.positive("high_freq_factor"),
        )
    return Rope(**fields, factor=factor)  # linear, dynamic


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

    def bad(self, key, value, want: str):
        return ConfigError(f"{self.source}: {key} = {value!r} must be {want}")

    def int(self, key, default=_MISSING, minimum: int = 1) -> int:
        value = self._get(key, default)
        # JSON writers may spell a whole number as 2.0; anything else fractional is a mistake, not a truncation.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not is_int(value) or value < minimum:
            raise self.bad(key, value, f"an integer >= {minimum}")
        return value

    def positive(self, key, default=_MISSING) -> float:
        value = self._get(key, default)
        if not is_finite_number(value) or value <= 0:
            raise self.bad(key, value, "a finite number > 0")
        return float(value)

    def choice(self, key, options: tuple[str, ...], default) -> str:
        value = self._get(key, default)
        if value not in options:
            raise self.bad(key, value, f"one of {', '.join(options)}")
        return value

    def bool(self, key, default=_MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return value

    def object(self, key) -> dict:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self.bad(key, value, "an object")
        return value

    def window(self) -> int | None:
        """The sliding window: absent, null, 0 or false mean full attention."""
        value = self.hf.get("sliding_window")
        return None if value in (None, 0, False) else self.int("sliding_window")

    def layer_list(self, key, num_layers: int) -> list[int]:
        value = self._get(key, [])
        if not isinstance(value, list) or not all(is_int(i) and 0 <= i < num_layers for i in value):
            raise self.bad(key, value, f"a list of layer indices in [0, {num_layers})")
        return value

    def layer_types(self, kinds: tuple[str, ...], default: list[str], key: str = "layer_types") -> list[str]:
        """`key` (`layer_types`): one of `kinds` per layer (absent: `default`)."""
        value = self._get(key, default)
        if not isinstance(value, list) or len(value) != len(default) or any(t not in kinds for t in value):
            raise self.bad(key, value, f"a list of {len(default)} of {', '.join(kinds)}")
        return value

    def token_ids(self, key) -> tuple[int, ...]:
        value = self._get(key, [])
        ids = value if isinstance(value, list) else [value]
        if not all(is_int(i) and i >= 0 for i in ids):
            raise self.bad(key, value, "a token id or a list of token ids")
        return tuple(ids)


def _qwen_windows(read: _Fields, num_layers: int) -> tuple[int | None, ...]:
    window = read.window()
    if not read.bool("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    layer_types = read.hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise read.bad("layer_types", layer_types, f"a list of {num_layers} layer types")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    max_window_layers = read.int("max_window_layers", num_layers, minimum=0)
    return tuple(window if i >= max_window_layers else None for i in range(num_layers))
