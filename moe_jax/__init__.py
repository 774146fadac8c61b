"""moe_jax: LoRA fine-tuning and batch generation for MoE models whose experts live in host RAM."""

from moe_jax.api import BACKENDS, Model, load_model
from moe_jax.errors import CheckpointError, ConfigError, InputError, MoeJaxError
from moe_jax.model.config import ModelConfig

__all__ = [
    "BACKENDS",
    "CheckpointError",
    "ConfigError",
    "InputError",
    "Model",
    "ModelConfig",
    "MoeJaxError",
    "load_model",
]
