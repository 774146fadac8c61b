"""Training run configuration: one dataclass; a TOML file sets it, command-line flags override the file."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from host_kernels import QUANTIZED
from moe_jax import bundled
from moe_jax.api import AUTO_DTYPE, DTYPE_CHOICES
from moe_jax.backends import BACKENDS
from moe_jax.backends.placements import check_device_experts_flag
from moe_jax.errors import ConfigError, InputError
from moe_jax.model.lora import ATTENTION_TARGETS, KNOWN_TARGETS

SCHEDULES = ("cosine", "linear", "constant")
LONG_EXAMPLES = ("truncate", "drop")


# settings whose name changed: old -> new (a config file with the old name is refused, naming the new one)
RENAMED = {"device_budget_mb": "device_memory_mb", "placement_plan": "device_experts"}


# what each setting does, for `moe-jax train --help` (every field of TrainConfig has one: tests check it)
SETTINGS_HELP = {
    "model": "checkpoint directory, .gguf file or Hugging Face Hub id to fine-tune",
    "data": "training JSONL: {text}, {instruction, input, output} or chat {messages}",
    "eval_data": "held-out JSONL (unset with your own --data: eval_fraction of it is held out)",
    "eval_fraction": "share of --data held out when no --eval-data is given",
    "out": "run directory: adapter/, checkpoints/, metrics.jsonl, loss.png",
    "backend": "where the experts compute",
    "dtype": "base weights and activations: auto keeps the checkpoint's own",
    "quant": "quantize the experts as they load (LoRA on a quantized base; host backend)",
    "device_experts": 'hybrid backend: JSON file {"layer": [expert ids]} of the experts kept on the device',
    "lora_rank": "rank of every LoRA adapter",
    "lora_alpha": "LoRA scale numerator (the update is scaled by alpha / rank)",
    "lora_dropout": "dropout on the LoRA inputs",
    "lora_targets": "modules that get adapters: attention, q_proj, ..., gate_proj, ..., experts",
    "learning_rate": "peak learning rate (AdamW)",
    "schedule": "learning-rate schedule after the warmup",
    "warmup_steps": "steps of linear warmup from 0",
    "weight_decay": "AdamW weight decay on the LoRA parameters",
    "max_grad_norm": "clip the gradient's global norm to this (0: no clipping)",
    "adam_b1": "AdamW's first-moment decay",
    "adam_b2": "AdamW's second-moment decay",
    "adam_eps": "AdamW's epsilon",
    "batch_size": "examples per optimizer step (split over processes in a multi-process run)",
    "grad_accum": "micro-batches accumulated into one step (each batch_size / grad_accum examples)",
    "max_seq_len": "tokens per example (longer ones: see long_examples)",
    "max_steps": "optimizer steps to run",
    "pack": "pack several examples into each sequence",
    "long_examples": "what to do with an example longer than max_seq_len",
    "skip_bad_lines": "skip malformed data lines (counted) instead of stopping at the first",
    "eval_interval": "steps between held-out evaluations",
    "eval_exact_match": "held-out examples generated greedily for exact-match accuracy (0: off)",
    "checkpoint_interval": "steps between checkpoints (--resume continues from the latest)",
    "keep_checkpoints": "checkpoints kept (older ones removed)",
    "seed": "seed of LoRA initialisation, dropout and data order",
    "host_threads": "host expert engine threads (default: every core)",
    "expert_shards": "expert parallel: each process holds 1/N of every layer's experts (one shard per process)",
    "pipeline": "micro-batches of the device/host pipeline (default: the plan's choice, off on a CPU)",
    "device_memory_mb": "offload/auto backends: device memory for expert weights, MiB (0: the default)",
    "tensorboard": "directory for TensorBoard event files of every step's figures",
}


@dataclass
class TrainConfig:
    model: str = str(bundled.MODEL)
    data: str = str(bundled.TRAIN_DATA)
    eval_data: str | None = str(bundled.EVAL_DATA)  # with other `data` and no eval_data given: none (held out)
    eval_fraction: float = 0.05  # held out from `data` when no eval_data is given
    out: str = "runs/default"
    backend: str = "host"
    # of the base weights and activations: "auto" keeps the checkpoint's own (bfloat16 for a bfloat16 checkpoint),
    # "float32" or "bfloat16" whatever it holds; bfloat16 runs the experts on AMX where there is one
    dtype: str = AUTO_DTYPE
    quant: str | None = None  # the experts quantized (int8, int4, ...): LoRA on a quantized base (host backend)
    device_experts: str | None = None  # hybrid: JSON file {"layer": [expert ids]} of the experts on the device
    # LoRA
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: list(ATTENTION_TARGETS))
    # optimisation
    learning_rate: float = 2e-3
    schedule: str = "cosine"
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    # batches
    batch_size: int = 16
    grad_accum: int = 1
    max_seq_len: int = 32
    max_steps: int = 400
    pack: bool = False
    long_examples: str = "truncate"
    skip_bad_lines: bool = False
    # evaluation and checkpoints
    eval_interval: int = 50
    eval_exact_match: int = 100  # held-out examples generated greedily for exact-match accuracy (0: off)
    checkpoint_interval: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    host_threads: int | None = None
    # a multi-process run: each process holds 1/expert_shards of every layer's experts (expert parallel; one
    # shard per process, host backend); 1: every process holds them all (data parallel)
    expert_shards: int = 1
    # micro-batches of the device/host pipeline (backends/pipeline.py); unset: the plan's choice (off on a CPU)
    pipeline: int | None = None
    # offload/auto: device memory for expert weights, in MiB as infer.py's --device-memory-mb (0: the default)
    device_memory_mb: float = 0.0
    tensorboard: str | None = None  # directory for TensorBoard event files: every step's figures as scalars

    def validate(self):
        def positive(name):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

        for name in (
            "lora_rank",
            "batch_size",
            "grad_accum",
            "max_seq_len",
            "max_steps",
            "eval_interval",
            "checkpoint_interval",
            "keep_checkpoints",
            "expert_shards",
        ):
            positive(name)
        if self.pipeline is not None:
            positive("pipeline")
        if self.expert_shards > 1 and self.backend != "host":
            raise ConfigError(f"expert_shards > 1 runs on the host backend only, not backend {self.backend!r}")

        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        try:
            check_device_experts_flag(self.backend, self.device_experts)
        except InputError as e:
            raise ConfigError(str(e)) from None

        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.quant is not None and self.quant not in QUANTIZED:
            raise ConfigError(f"quant must be one of {', '.join(QUANTIZED)}, got {self.quant!r}")
        for name in ("learning_rate", "lora_alpha", "weight_decay", "max_grad_norm", "adam_eps", "device_memory_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.learning_rate == 0:
            raise ConfigError("learning_rate must be > 0")
        unknown = [t for t in self.lora_targets if t not in KNOWN_TARGETS]
        if unknown:
            raise ConfigError(f"unknown LoRA target module(s) {unknown}; known: {', '.join(KNOWN_TARGETS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.long_examples not in LONG_EXAMPLES:
            raise ConfigError(f"long_examples must be one of {LONG_EXAMPLES}, got {self.long_examples!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        return self

    @classmethod
    def from_sources(cls, config_file: str | None, overrides: dict) -> TrainConfig:
        values = {}
        if config_file:
            path = Path(config_file)
            try:
                values = tomllib.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"{path}: no such config file") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: invalid TOML ({e})") from None
            known = {f.name for f in dataclasses.fields(cls)}
            for old, new in RENAMED.items():
                if old in values:
                    raise ConfigError(f"{path}: the setting {old!r} is now called {new!r}")
            unknown = sorted(set(values) - known)
            if unknown:
                raise ConfigError(f"{path}: unknown setting(s) {unknown}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        if Path(values.get("data", bundled.TRAIN_DATA)).resolve() != bundled.TRAIN_DATA and "eval_data" not in values:
            values["eval_data"] = None  # the bundled task's held-out file says nothing about other data
        return cls(**values).validate()

    @staticmethod
    def choices() -> dict[str, tuple[str, ...]]:
        """The settings that take one of a few values, and those values."""
        return {
            "backend": tuple(BACKENDS),
            "dtype": DTYPE_CHOICES,
            "quant": tuple(QUANTIZED),
            "schedule": SCHEDULES,
            "long_examples": LONG_EXAMPLES,
        }

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
