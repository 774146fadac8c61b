"""A malformed adapter_config.json is a CheckpointError naming the file and the field; PEFT settings moe_jax would
ignore (and so compute something else) are refused; rank-stabilised LoRA matches peft (issue 15, item 10)."""

import json

import numpy as np
import pytest

import moe_jax
from moe_jax.errors import CheckpointError
from moe_jax.formats.adapters import adapter_config
from tests.hf_models import float32_atol, hf_logits, make_hf_model, save_hf_model

GOOD = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_good_config():
    config = adapter_config(GOOD, "a/adapter_config.json")
    assert (config.rank, config.scale, config.targets) == (4, 2.0, ("q_proj", "v_proj"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"r": None}, "r = None must be an integer >= 1"),
        ({"r": "8"}, "r = '8' must be an integer >= 1"),
        ({"r": 0}, "r = 0"),
        ({"r": 2.5}, "r = 2.5"),
        ({"lora_alpha": None}, "lora_alpha = None must be a finite number > 0"),
        ({"lora_alpha": "16"}, "lora_alpha = '16'"),
        ({"lora_alpha": float("nan")}, "lora_alpha = nan"),
        ({"target_modules": "q_proj|v_proj"}, "regex target_modules"),
        ({"target_modules": [1, 2]}, "target_modules = [1, 2] must be a non-empty list of module names"),
        ({"target_modules": {"q_proj": 1}}, "target_modules = {'q_proj': 1}"),
        ({"target_modules": []}, "target_modules = []"),
        ({"target_modules": ["nonsense_proj"]}, "unknown LoRA target module(s) ['nonsense_proj']"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({"use_dora": True}, "DoRA adapters are not supported"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"bias": "all"}, "bias = 'all' is not supported"),
    ],
)
def test_malformed_adapter_config(change, message):
    with pytest.raises(CheckpointError, match="a/adapter_config.json") as info:
        adapter_config({**GOOD, **change}, "a/adapter_config.json")
    assert message in str(info.value)


def test_adapter_config_that_is_not_an_object():
    with pytest.raises(CheckpointError, match="expected a JSON object, got list"):
        adapter_config([GOOD], "a/adapter_config.json")


def test_moe_jax_targets_file_is_checked_too(tmp_path):
    from moe_jax.formats.adapters import read_adapter

    (tmp_path / "adapter_config.json").write_text(json.dumps(GOOD))
    (tmp_path / "moe_jax_adapter.json").write_text(json.dumps({"targets": "experts"}))
    with pytest.raises(CheckpointError, match="regex target_modules 'experts'"):
        read_adapter(tmp_path)


def test_rank_stabilised_lora_gives_peft_logits(tmp_path):
    peft = pytest.importorskip("peft")
    import torch

    hf = make_hf_model("qwen3_moe", seed=2)
    base = save_hf_model(hf, tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], use_rslora=True)
    peft_model = peft.get_peft_model(hf, config)
    with torch.no_grad():  # peft starts B at zero; a random B makes the adapter (and its scale) matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = np.random.default_rng(0).integers(0, 96, size=(1, 7))
    theirs = hf_logits(peft_model.eval(), ids)
    ours = moe_jax.load_model(base, backend="device", adapter=tmp_path / "adapter").logits(ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_adapter_with_non_finite_weights_is_refused(tmp_path):
    from moe_jax.formats.adapters import apply_adapter
    from moe_jax.model.lora import LoRAConfig

    model = moe_jax.load_model(save_hf_model(make_hf_model("mixtral", seed=1), tmp_path / "base"), backend="device")
    model.attach_lora(LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",)))
    d, q = model.config.hidden_size, model.config.num_heads * model.config.head_dim
    tensors = {}
    for layer in range(model.config.num_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = np.zeros((2, d), np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.full((q, 2), np.nan if layer == 1 else 0.0, np.float32)
    with pytest.raises(CheckpointError, match=r"layers.1.self_attn.q_proj.lora_B.weight holds NaN or infinite"):
        apply_adapter(model.transformer, tensors, "adapter")


@pytest.mark.parametrize(
    "variant",
    [
        "mixtral",
        "qwen2_moe",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe",
        "olmoe",
        "minimax_m2",
        "qwen3_next",
    ],
)
def test_routed_expert_adapters_export_to_peft_with_equal_logits(tmp_path, variant):
    """Routed-expert LoRA goes to peft as LoRA on the fused expert parameters (target_parameters): peft loads the
    whole adapter and computes moe_jax's logits; moe_jax reads its own export back exactly."""
    peft = pytest.importorskip("peft")
    import jax
    import torch

    from moe_jax.formats.adapters import export_peft
    from moe_jax.model.lora import LoRAConfig, split_trainable

    hf = make_hf_model(variant, seed=3)
    base = save_hf_model(hf, tmp_path / "base")
    model = moe_jax.load_model(base, backend="device")
    # every attention projection of the latent and linear attentions (Qwen3-Next: its DeltaNet's too)
    plain = model.config.mla is None and not model.config.linear_layers
    attention = ("q_proj", "v_proj") if plain else ("attention",)
    model.attach_lora(LoRAConfig(rank=3, alpha=5.0, targets=(*attention, "experts")), seed=1)
    config = model.lora_config  # "attention" resolved to the family's projections
    _, lora_state, _ = split_trainable(model.transformer)
    leaves, treedef = jax.tree.flatten(lora_state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    model.set_lora_state(
        jax.tree.unflatten(treedef, [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)])
    )
    export_peft(model.transformer, config, tmp_path / "adapter", str(base))
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 9))
    ours = model.logits(ids)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    theirs = hf_logits(peft_model, ids)
    assert np.abs(ours - moe_jax.load_model(base, backend="device").logits(ids)).max() > 1e-2
    np.testing.assert_allclose(ours, theirs, atol=float32_atol(variant, 1e-4), rtol=0)
    again = moe_jax.load_model(base, backend="host", adapter=tmp_path / "adapter").logits(ids)
    np.testing.assert_allclose(again, ours, atol=float32_atol(variant, 1e-5), rtol=0)
    with torch.no_grad():
        assert any("experts" in name and "lora_A" in name for name, _ in peft_model.named_parameters())


def test_mlp_adapters_peft_would_mislay_are_exported_in_moe_jax_format_only(tmp_path):
    """peft maps gate/up/down_proj targets of DeepSeek-style families to the routed experts: an adapter on the
    shared and dense MLPs is written for moe_jax alone (no adapter_config.json, so peft refuses it rather than
    loading it onto the experts), and moe_jax reads it back exactly."""
    peft = pytest.importorskip("peft")
    import jax

    from moe_jax.formats.adapters import PEFT_CONFIG, export_peft
    from moe_jax.model.lora import LoRAConfig, split_trainable

    hf = make_hf_model("deepseek_v3", seed=3)
    base = save_hf_model(hf, tmp_path / "base")
    model = moe_jax.load_model(base, backend="device")
    model.attach_lora(LoRAConfig(rank=3, alpha=5.0, targets=("attention", "gate_proj", "up_proj", "down_proj")))
    _, lora_state, _ = split_trainable(model.transformer)
    leaves, treedef = jax.tree.flatten(lora_state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    model.set_lora_state(
        jax.tree.unflatten(treedef, [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)])
    )
    why = export_peft(model.transformer, model.lora_config, tmp_path / "adapter", str(base))
    assert "maps the targets gate_proj, up_proj, down_proj of a deepseek_v3 model to its routed experts" in why
    assert not (tmp_path / "adapter" / PEFT_CONFIG).exists()
    with pytest.raises(ValueError):
        peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 9))
    ours = model.logits(ids)
    assert np.abs(ours - moe_jax.load_model(base, backend="device").logits(ids)).max() > 1e-2
    again = moe_jax.load_model(base, backend="host", adapter=tmp_path / "adapter").logits(ids)
    np.testing.assert_allclose(again, ours, atol=1e-5, rtol=0)


def test_a_target_the_family_lacks_is_refused(tmp_path):
    from moe_jax.errors import ConfigError
    from moe_jax.model.lora import LoRAConfig

    model = moe_jax.load_model(save_hf_model(make_hf_model("deepseek_v2", seed=1), tmp_path), backend="device")
    message = r"\['k_proj'\] name no module of this deepseek_v2 model.*'attention' = q_proj"
    with pytest.raises(ConfigError, match=message):
        model.attach_lora(LoRAConfig(targets=("q_proj", "k_proj")))
