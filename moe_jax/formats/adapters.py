"""LoRA adapters on disk: Hugging Face PEFT format (export and import) and moe_jax training checkpoints.

How it works and why: docs/INTERNALS.md, moe_jax/formats/adapters.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.errors import CheckpointError, ConfigError, is_finite_number, is_int, read_json_file
from moe_jax.formats import hf_names
from moe_jax.formats.safetensors_io import SafetensorsFile, save_safetensors
from moe_jax.model.layers import Projection
from moe_jax.model.lora import EXPERTS_TARGET, MLP_TARGETS, LoRAConfig
from moe_jax.model.moe import MoEBlock

PEFT_CONFIG = "adapter_config.json"
MOE_JAX_CONFIG = "moe_jax_adapter.json"  # targets PEFT cannot express (routed experts)
PEFT_WEIGHTS = "adapter_model.safetensors"
EXPERT_WEIGHTS = "moe_jax_expert_lora.safetensors"


def lora_modules(transformer):
    """(hf name, Projection) for every projection with an adapter, and (hf name, experts) for expert adapters."""
    projections, experts = [], []
    for path, module in nnx.iter_modules(transformer):
        name = hf_names.module_name(path, transformer.config)
        if isinstance(module, Projection) and module.lora_a is not None:
            projections.append((name, module))
        elif isinstance(module, MoEBlock) and getattr(module.experts, "lora", None) is not None:
            experts.append((name + ".experts", module.experts))
    return projections, experts


# Families whose MoE layout transformers 5 fused (its conversion pattern "qwen2_moe"): peft (>= 0.18, loading onto
# transformers 5) rewrites the targets gate_proj / up_proj / down_proj of these to the routed experts' fused
# parameters, as adapters trained on transformers 4's per-expert modules meant them. An adapter on their dense or
# shared-expert MLPs therefore cannot be written for peft: peft would put it on the experts, silently.
PEFT_REMAPS_MLP_TARGETS = (
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "olmoe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
)


def peft_unexpressible(lora_config: LoRAConfig, model_config) -> str:
    """Why peft cannot load this adapter as trained ("" where it can)."""
    mlp = [t for t in lora_config.targets if t in MLP_TARGETS]
    if mlp and model_config.model_type in PEFT_REMAPS_MLP_TARGETS:
        return (
            f"peft maps the targets {', '.join(mlp)} of a {model_config.model_type} model to its routed experts, "
            "so it cannot hold adapters on the dense or shared-expert MLPs"
        )
    return ""


def export_peft(transformer, lora_config: LoRAConfig, out_dir, base_model: str) -> str:
    """Writes the adapter in PEFT format (atomically: a temporary directory renamed into place). Where peft cannot
    express it (`peft_unexpressible`), in moe_jax's format only, which moe_jax reads back and peft refuses to load
    (no adapter_config.json) rather than mislay; returns why ("" for a PEFT adapter)."""
    not_for_peft = peft_unexpressible(lora_config, transformer.config)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    projections, experts = lora_modules(transformer)
    tensors = {}
    for name, module in projections:
        tensors[_peft_key(name, "A")] = np.asarray(module.lora_a[...], np.float32).T.copy()
        tensors[_peft_key(name, "B")] = np.asarray(module.lora_b[...], np.float32).T.copy()
    peft_targets = sorted({t for t in lora_config.targets if t != EXPERTS_TARGET})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": lora_config.rank,
        "lora_alpha": lora_config.alpha,
        "lora_dropout": lora_config.dropout,
        "target_modules": peft_targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    if experts:
        arrays = {name: {k: np.asarray(v[...], np.float32) for k, v in mod.lora.items()} for name, mod in experts}
        for name, lora in arrays.items():
            tensors.update(peft_expert_tensors(name, lora))
        fused = "experts.gate_up_proj"
        config["target_parameters"] = [fused, "experts.down_proj"]  # this order: gate_up_proj is the inner wrapper
        config["rank_pattern"] = {fused: 2 * lora_config.rank}
        config["alpha_pattern"] = {fused: 2 * lora_config.alpha}  # the same alpha / r at twice the rank
        expert_tensors = {f"{name}.{key}": value for name, lora in arrays.items() for key, value in lora.items()}
        save_safetensors(tmp / EXPERT_WEIGHTS, expert_tensors)
    save_safetensors(tmp / PEFT_WEIGHTS, tensors)
    ours = {"targets": list(lora_config.targets)}
    if not_for_peft:
        ours.update(not_for_peft=not_for_peft, lora_config=config)
    else:
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=1))
    (tmp / MOE_JAX_CONFIG).write_text(json.dumps(ours, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return not_for_peft


def peft_expert_tensors(name: str, lora: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One MoE block's routed-expert adapters as peft's ParamWrapper tensors. peft keeps an adapter on a 3-D
    parameter [experts, out, in] as lora_A [experts * r, in] (row e * r + k) and lora_B [out, r * experts]
    (column k * experts + e), and adds scaling * B_e @ A_e to expert e's weight. moe_jax's adapters are
    `<proj>_a` [experts, in, r] and `<proj>_b` [experts, r, out]."""
    module = hf_names.peft_module(name)
    e, hidden, r = lora["gate_a"].shape
    ffn = lora["gate_b"].shape[2]
    a = np.concatenate([lora["gate_a"], lora["up_a"]], axis=2).transpose(0, 2, 1)  # [e, 2r, hidden]
    b = np.zeros((e, 2 * ffn, 2 * r), np.float32)  # block-diagonal: gate's B on gate's rows, up's on up's
    b[:, :ffn, :r] = lora["gate_b"].transpose(0, 2, 1)
    b[:, ffn:, r:] = lora["up_b"].transpose(0, 2, 1)

    def stacked(a_eri, b_eor):
        return a_eri.reshape(-1, a_eri.shape[-1]), b_eor.transpose(1, 2, 0).reshape(b_eor.shape[1], -1)

    gate_up_a, gate_up_b = stacked(a, b)
    down_a, down_b = stacked(lora["down_a"].transpose(0, 2, 1), lora["down_b"].transpose(0, 2, 1))
    return {
        f"{module}.base_layer.lora_A.weight": gate_up_a,
        f"{module}.base_layer.lora_B.weight": gate_up_b,
        f"{module}.lora_A.weight": down_a,
        f"{module}.lora_B.weight": down_b,
    }


def read_adapter(adapter_dir) -> tuple[LoRAConfig, dict[str, np.ndarray]]:
    """(LoRA config, tensors by name) of a PEFT-format directory (as exported, or by peft itself)."""
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / PEFT_CONFIG
    targets, extra = None, None
    ours = (adapter_dir / MOE_JAX_CONFIG).exists()
    if ours:
        extra = read_json_file(adapter_dir / MOE_JAX_CONFIG, "an adapter directory")
        targets = extra.get("targets") if isinstance(extra, dict) else extra
    if not config_file.exists() and isinstance(extra, dict) and "lora_config" in extra:
        config_file = adapter_dir / MOE_JAX_CONFIG  # moe_jax's format only (export_peft)
        config = extra["lora_config"]
    else:
        config = read_json_file(config_file, "an adapter directory")
    if ours:  # the expert settings it wrote for peft describe the tensors moe_jax reads from its own file
        config = {k: v for k, v in config.items() if k not in ("target_parameters", "rank_pattern", "alpha_pattern")}
    lora_config = adapter_config(config, config_file, targets)
    tensors = {}
    for file in (PEFT_WEIGHTS, EXPERT_WEIGHTS):
        if (adapter_dir / file).exists():
            f = SafetensorsFile(adapter_dir / file)
            # moe_jax's own export: the routed experts' peft form is for peft; the side file has them exactly
            keys = [k for k in f.keys() if not (ours and file == PEFT_WEIGHTS and ".experts." in k)]
            tensors.update({k: np.asarray(f.get(k), np.float32) for k in keys})
    if not tensors:
        raise CheckpointError(f"{adapter_dir}: no {PEFT_WEIGHTS}")
    return lora_config, tensors


# PEFT settings that change what an adapter computes; moe_jax would ignore them and give silently wrong outputs.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layers_to_transform": "adapters on some layers only (layers_to_transform)",
    "target_parameters": "adapters on parameters made by peft (target_parameters)",
}


def adapter_config(config, config_file, targets=None) -> LoRAConfig:
    """The LoRAConfig of a PEFT `adapter_config.json` (its targets overridden by moe_jax's own file, which can
    name routed experts); every field type-checked, so a malformed adapter is a CheckpointError naming the file."""

    def bad(message):
        return CheckpointError(f"{config_file}: {message}")

    if not isinstance(config, dict):
        raise bad(f"expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise bad(f"{what} are not supported ({key} = {config[key]!r})")
    if config.get("bias", "none") != "none":
        raise bad(f"bias = {config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not is_int(rank) or rank < 1:
        raise bad(f"r = {rank!r} must be an integer >= 1")
    if not is_finite_number(alpha) or alpha <= 0:
        raise bad(f"lora_alpha = {alpha!r} must be a finite number > 0")
    targets = config.get("target_modules") if targets is None else targets
    if isinstance(targets, str):
        raise bad(f"regex target_modules {targets!r} are not supported; list the modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise bad(f"target_modules = {targets!r} must be a non-empty list of module names")
    scale_alpha = alpha
    if config.get("use_rslora"):  # rank-stabilised LoRA scales by alpha / sqrt(r), not alpha / r
        scale_alpha = alpha * math.sqrt(rank)
    try:
        return LoRAConfig(rank=rank, alpha=float(scale_alpha), targets=tuple(targets))
    except ConfigError as e:
        raise bad(str(e)) from None


def apply_adapter(transformer, tensors: dict[str, np.ndarray], source) -> None:
    """Copies adapter tensors into the attached (freshly initialised) adapters; refuses what does not fit."""
    projections, experts = lora_modules(transformer)
    owners = {}
    for name, module in projections:
        owners[_peft_key(name, "A")] = (module, "lora_a", True)
        owners[_peft_key(name, "B")] = (module, "lora_b", True)
    for name, mod in experts:
        for key in mod.lora:
            owners[f"{name}.{key}"] = (mod.lora, key, False)

    def target_of(owner, attr):
        return getattr(owner, attr) if not isinstance(owner, nnx.Dict) else owner[attr]

    expected = {key: (tuple(target_of(owner, attr).shape), t) for key, (owner, attr, t) in owners.items()}
    for key, value in checked_tensors(expected, tensors, source).items():
        owner, attr, _ = owners[key]
        target = target_of(owner, attr)
        target[...] = jnp.asarray(value, target.dtype)


def projection_adapters(transformer, lora_config: LoRAConfig, tensors: dict[str, np.ndarray], source) -> dict:
    """{projection path: (A [in, r], B [r, out])} of an adapter on the attention / MLP projections, for a model
    that does not attach it (per-request adapters); refuses what does not fit, as `apply_adapter`."""
    projections = {}
    for path, module in nnx.iter_modules(transformer):
        if isinstance(module, Projection) and path and str(path[-1]) in lora_config.targets:
            projections[hf_names.module_name(path, transformer.config)] = (path, module.weight.shape)
    expected = {}
    for name, (_, (fan_in, fan_out)) in projections.items():
        expected[_peft_key(name, "A")] = ((fan_in, lora_config.rank), True)
        expected[_peft_key(name, "B")] = ((lora_config.rank, fan_out), True)
    values = checked_tensors(expected, tensors, source)
    return {
        path: (values[_peft_key(name, "A")], values[_peft_key(name, "B")]) for name, (path, _) in projections.items()
    }


def checked_tensors(expected: dict[str, tuple[tuple[int, ...], bool]], tensors: dict[str, np.ndarray], source):
    """{name: array} of an adapter's tensors for `expected` {name: (shape in moe_jax's layout, whether peft's is
    its transpose)}, in moe_jax's layout: none missing or extra, each of its shape and finite, or a CheckpointError
    naming `source`."""
    peft_names = {_strip_default(k): k for k in tensors}
    missing = sorted(set(expected) - set(peft_names))
    extra = sorted(set(peft_names) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{source}: adapter does not fit this model: "
            + (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}; " if missing else "")
            + (f"unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}" if extra else "")
        )
    values = {}
    for key, (shape, transpose) in expected.items():
        value = tensors[peft_names[key]]
        value = value.T if transpose else value
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{source}: adapter tensor {key} has shape {value.shape}, this model needs {shape}")
        if not np.isfinite(value).all():  # would turn every output into NaN, silently
            raise CheckpointError(f"{source}: adapter tensor {key} holds NaN or infinite values")
        values[key] = value
    return values


def _peft_key(module_name: str, side: str) -> str:
    return f"base_model.model.{module_name}.lora_{side}.weight"


def _strip_default(key: str) -> str:
    """peft may save keys with the adapter name (`.lora_A.default.weight`); ours have none."""
    return key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
