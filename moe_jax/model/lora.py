"""LoRA adapters: which modules they target, how they are initialised, and attaching them to a model.

How it works and why: docs/INTERNALS.md, moe_jax/model/lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.errors import ConfigError
from moe_jax.model.delta_net import DELTA_NET_PROJECTIONS, DELTA_NET_SPLIT_PROJECTIONS, input_projections
from moe_jax.model.layers import LoRAParam, Projection
from moe_jax.model.moe import MoEBlock

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
DELTA_NET_OUTPUT = "out_proj"
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERTS_TARGET = "experts"
ATTENTION_ALIAS = "attention"
KNOWN_TARGETS = tuple(
    dict.fromkeys(
        (
            *ATTENTION_TARGETS,
            *MLA_TARGETS,
            *DELTA_NET_PROJECTIONS,
            *DELTA_NET_SPLIT_PROJECTIONS,
            DELTA_NET_OUTPUT,
            *MLP_TARGETS,
            EXPERTS_TARGET,
            ATTENTION_ALIAS,
        )
    )
)


def attention_targets(model_config) -> tuple[str, ...]:
    """The attention projections of a model of this config (what the `attention` target stands for): with
    linear-attention layers, theirs too."""
    if model_config.linear_layers:
        return (*ATTENTION_TARGETS, *input_projections(model_config.linear_attention), DELTA_NET_OUTPUT)
    if model_config.mla is None:
        return ATTENTION_TARGETS
    query = ("q_a_proj", "q_b_proj") if model_config.mla.q_lora_rank else ("q_proj",)
    return (*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def resolve_targets(targets, model_config) -> tuple[str, ...]:
    """`targets` with `attention` expanded, each checked to name modules this model has (a target that matched
    nothing would train nothing there, silently)."""
    attention = attention_targets(model_config)
    resolved = []
    for t in targets:
        resolved += attention if t == ATTENTION_ALIAS else [t]
    resolved = tuple(dict.fromkeys(resolved))
    has_mlps = bool(model_config.dense_layers) or model_config.shared_expert_intermediate_size > 0
    available = (*attention, *(MLP_TARGETS if has_mlps else ()), EXPERTS_TARGET)
    missing = [t for t in resolved if t not in available]
    if missing:
        raise ConfigError(
            f"LoRA target(s) {missing} name no module of this {model_config.model_type} model; its targets: "
            f"{', '.join(available)} ({ATTENTION_ALIAS!r} = {', '.join(attention)})"
        )
    return resolved


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ATTENTION_TARGETS
    dropout: float = 0.0  # on the adapter input of attention/MLP projections (not routed experts), training only

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in KNOWN_TARGETS]
        if unknown:
            raise ConfigError(f"unknown LoRA target module(s) {unknown}; known: {', '.join(KNOWN_TARGETS)}")
        if self.rank < 1:
            raise ConfigError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _kaiming_a(key, shape, fan_in, dtype):
    bound = 1.0 / np.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def attach_lora(transformer, config: LoRAConfig, seed: int = 0):
    """Adds freshly initialised adapters to every targeted module of `transformer`, in place."""
    key = jax.random.key(seed)
    index = 0
    for path, module in sorted(nnx.iter_modules(transformer), key=lambda item: _path_key(item[0])):
        name = str(path[-1]) if path else ""
        if isinstance(module, Projection) and name in config.targets:
            key, sub = jax.random.split(key)
            fan_in, fan_out = module.weight.shape
            # float32 adapters on any base, as peft keeps them (autocast_adapter_dtype): AdamW steps on bfloat16
            # weights would round most of each update away
            module.attach_lora(
                _kaiming_a(sub, (fan_in, config.rank), fan_in, jnp.float32),
                jnp.zeros((config.rank, fan_out), jnp.float32),
                config.scale,
                config.dropout,
                index,
            )
            index += 1
        elif isinstance(module, MoEBlock) and EXPERTS_TARGET in config.targets:
            key, sub = jax.random.split(key)
            attach_expert_lora(module.experts, sub, transformer.config, config)


def attach_expert_lora(experts, key, model_config, config: LoRAConfig):
    e, d, f, r = (
        model_config.num_experts,
        model_config.hidden_size,
        model_config.expert_intermediate_size,
        config.rank,
    )
    keys = jax.random.split(key, 3)
    arrays = {}
    for k, (name, fan_in, fan_out) in zip(keys, (("gate", d, f), ("up", d, f), ("down", f, d)), strict=True):
        arrays[f"{name}_a"] = LoRAParam(_kaiming_a(k, (e, fan_in, r), fan_in, jnp.float32))
        arrays[f"{name}_b"] = LoRAParam(jnp.zeros((e, r, fan_out), jnp.float32))
    experts.lora = nnx.Dict(arrays)
    experts.lora_scale = config.scale


def _path_key(path) -> tuple:
    """Sort key that orders layers numerically, so initialisation is reproducible and peft-comparable."""
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in path)


def split_trainable(transformer):
    """(graphdef, LoRA state, everything else) for jit/grad over the adapters alone."""
    return nnx.split(transformer, LoRAParam, ...)
