"""GPT-OSS (issue 50): attention sinks, sliding-window and full layers in turn, a router with a bias whose top-k
logits are softmaxed, experts with biases and a clamped SwiGLU. Against transformers on the backends that compute
it (device, host: its fused forward, its engine's native and numpy passes), LoRA gradients host against device
(the engine's backward and the fused backward), the clamped passes against float64, adapters through peft."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from host_kernels import activations
from host_kernels.activations import GLU
from moe_jax.formats.hf_config import read_hf_config
from moe_jax.model.lora import LoRAConfig
from tests.hf_models import hf_logits, make_hf_model, save_hf_model, torch
from tests.isa import variants
from tests.test_backends import lora_loss_grad
from tests.test_generate import PROMPTS, hf_greedy

IDS = np.random.default_rng(0).integers(0, 96, size=(3, 13))  # 13 positions: past the sliding window of 5


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    hf = make_hf_model("gpt_oss", seed=3, pad_token_id=0)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.parametrize("native", [None, False], ids=["native", "numpy"])
def test_host_logits_match_transformers(gpt_oss, native):
    hf, path = gpt_oss
    model = moe_jax.load_model(path, backend="host", native=native)
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers_past_the_window(gpt_oss):
    """Decode steps attend over the cache with the sinks, the sliding layers' window moving past the prompt."""
    hf, path = gpt_oss
    model = moe_jax.load_model(path, backend="host")
    assert model.plan.cache_attention is False  # the native cache attention has no sinks
    assert model.generate(PROMPTS, max_new_tokens=10) == [hf_greedy(hf, p, 10) for p in PROMPTS]


def assert_training_matches_the_device(model, path):
    """`model`'s LoRA loss and gradients (attention and expert adapters, random B) equal the device backend's."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, size=(2, 10)))
    ref_loss, ref_grad = lora_loss_grad(moe_jax.load_model(path, backend="device"), tokens)
    loss, grad = lora_loss_grad(model, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        scale = float(jnp.abs(want).max())
        assert scale > 0
        np.testing.assert_allclose(got / scale, want / scale, atol=1e-5)


@pytest.mark.parametrize("native", [None, False], ids=["native", "numpy"])
def test_lora_gradients_on_the_host_equal_the_devices(gpt_oss, native):
    """Expert LoRA runs the host engine's forward and backward (the clamped passes' derivative, the biases in the
    recomputed pre-activations); attention LoRA's gradients flow back through the experts too."""
    _, path = gpt_oss
    assert_training_matches_the_device(moe_jax.load_model(path, backend="host", native=native), path)


def test_offload_computes_its_experts_forward_and_backward(gpt_oss):
    """Offload's streamed expert slots take the clamped SwiGLU and the gate/up biases too (some rounds of two
    slots: every expert a layer routes to is copied in turn)."""
    hf, path = gpt_oss
    model = moe_jax.load_model(path, backend="offload", device_budget_bytes=1)  # the budget's floor: one slot
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)
    assert_training_matches_the_device(model, path)


def test_bfloat16_training_step_on_the_fused_backward_follows_the_device(gpt_oss):
    """Attention-only LoRA in bfloat16: the host's fused forward keeps the biased pre-activations and its fused
    backward differentiates the clamped SwiGLU (where the kernel choice has one), within bfloat16's rounding of
    the device's gradients."""
    _, path = gpt_oss
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, size=(2, 10)))
    config = LoRAConfig(rank=4, alpha=8, targets=("attention",))

    def loss_and_grad(backend):
        model = moe_jax.load_model(path, backend=backend, dtype="bfloat16")
        return lora_loss_grad(model, tokens, config)

    ref_loss, ref_grad = loss_and_grad("device")
    loss, grad = loss_and_grad("host")
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got - want).max()) / scale < 0.1


def reference_clamped(hg, hu, grad, weight, glu: GLU):
    """(act, dh_gate, dh_up, dw) in float64."""
    hg, hu, grad = (a.astype(np.float64) for a in (hg, hu, grad))
    g = np.minimum(hg, glu.limit)
    up1 = np.clip(hu, -glu.limit, glu.limit) + 1
    s = 1 / (1 + np.exp(-glu.alpha * g))
    act = up1 * g * s
    w = weight.astype(np.float64)[:, None]
    dh_gate = np.where(hg <= glu.limit, w * grad * up1 * s * (1 + glu.alpha * g * (1 - s)), 0)
    dh_up = np.where(np.abs(hu) <= glu.limit, w * grad * g * s, 0)
    return act, dh_gate, dh_up, np.sum(grad * act, axis=1)


@pytest.mark.parametrize("isa", [*variants(activations.status), pytest.param(None, id="numpy")])
def test_clamped_swiglu_passes_match_float64(isa):
    """Odd shapes (masked tails), values on both sides of both clamps."""
    glu = GLU("clamped_swiglu", alpha=1.702, limit=2.0)
    rng = np.random.default_rng(4)
    m, n = 5, 37
    hg, hu, grad = (rng.normal(0, 2.5, (m, n)).astype(np.float32) for _ in range(3))
    weight = rng.uniform(0.1, 1.0, m).astype(np.float32)
    act, dh_gate, dh_up, dw = reference_clamped(hg, hu, grad, weight, glu)
    out = np.empty((m, n), np.float32)
    activations.swiglu_forward(hg, hu, out, isa=isa, glu=glu)
    np.testing.assert_allclose(out, act, rtol=2e-6, atol=2e-6)
    got = [np.empty((m, n), np.float32) for _ in range(3)]
    got_dw = np.empty(m, np.float32)
    activations.swiglu_backward(hg.copy(), hu, grad.copy(), weight, got[0], got[1], got_dw, got[2], isa=isa, glu=glu)
    for name, value, want in (("dh_gate", got[0], dh_gate), ("dh_up", got[1], dh_up), ("act", got[2], act)):
        np.testing.assert_allclose(value, want, rtol=2e-6, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(got_dw, dw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["hybrid", "auto"])
def test_hybrid_placements_compute_its_experts_on_both_sides(gpt_oss, backend):
    """Half of every layer's experts in the device cache (hybrid), or auto on a synthetic machine whose planner
    caches, streams and leaves experts on the host in one call: the device share takes the clamped SwiGLU and the
    biases as the host share does; logits and LoRA gradients as the device's."""
    from tests.test_auto import load_auto
    from tests.test_backends import half_plan

    hf, path = gpt_oss
    config = moe_jax.load_model(path, backend="device").config
    if backend == "hybrid":
        model = moe_jax.load_model(path, backend="hybrid", device_experts=half_plan(config))
    else:
        model = load_auto(path, config, "mixed")
        assert model.memory_split()["experts_in_use"] > 0  # a device cache in use
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)
    assert_training_matches_the_device(model, path)


def test_release_config_reads_as_transformers_computes_it():
    """openai/gpt-oss-20b's config.json, as released (its quantization section aside)."""
    config = read_hf_config(
        dict(
            model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
            sliding_window=128, rope_theta=150000, max_position_embeddings=131072, rms_norm_eps=1e-5,
            swiglu_limit=7.0, attention_bias=True, layer_types=["sliding_attention", "full_attention"] * 12,
            rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                              original_max_position_embeddings=4096),
        )
    )  # fmt: skip
    assert config.sliding_windows[:4] == (128, None, 128, None) and config.attention_sinks
    assert (config.rope.kind, config.rope.factor, config.rope.truncate, config.rope.dim) == ("yarn", 32.0, False, 64)
    assert config.expert_glu == GLU("clamped_swiglu", alpha=1.702, limit=7.0) and config.expert_bias
    assert (config.router.scores, config.router.logit_bias, config.num_experts_per_tok) == ("topk_softmax", True, 4)


def test_attention_adapters_export_to_peft_with_equal_logits(gpt_oss, tmp_path):
    peft = pytest.importorskip("peft")
    from moe_jax.formats.adapters import export_peft
    from moe_jax.model.lora import split_trainable

    path = gpt_oss[1]
    hf = make_hf_model("gpt_oss", seed=3, pad_token_id=0)  # its own: peft wraps the modules it loads onto
    model = moe_jax.load_model(path, backend="host")
    model.attach_lora(LoRAConfig(rank=3, alpha=5.0, targets=("attention",)), seed=1)
    _, lora_state, _ = split_trainable(model.transformer)
    leaves, treedef = jax.tree.flatten(lora_state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    model.set_lora_state(
        jax.tree.unflatten(treedef, [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)])
    )
    export_peft(model.transformer, model.lora_config, tmp_path / "adapter", str(path))
    ours = model.logits(IDS)
    with torch.no_grad():
        theirs = hf_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval(), IDS)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert np.abs(ours - moe_jax.load_model(path, backend="device").logits(IDS)).max() > 1e-2


def mxfp4_release(hf, directory):
    """`hf`'s weights laid out as openai/gpt-oss-* ship (experts as MXFP4 blocks and scales, quantization_config
    mxfp4); returns the directory and the experts' dequantized values by name."""
    import json

    from moe_jax.formats.mxfp4 import RELEASE_QUANTIZATION_CONFIG, dequantize, release_blocks
    from moe_jax.formats.safetensors_io import save_safetensors

    source = save_hf_model(hf, directory / "float")
    tensors, dequantized = {}, {}
    for name, p in hf.state_dict().items():
        w = p.detach().float().numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = release_blocks(np.ascontiguousarray(np.swapaxes(w, -1, -2)))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dequantized[name] = np.asarray(dequantize(blocks, scales, name), np.float32)
            assert 0 < np.abs(dequantized[name] - w).max() < 0.3 * np.abs(w).max()  # quantized, not garbage
        else:
            tensors[name] = w
    release = directory / "release"
    release.mkdir()
    save_safetensors(release / "model.safetensors", tensors)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = RELEASE_QUANTIZATION_CONFIG
    (release / "config.json").write_text(json.dumps(config))
    return release, dequantized


def test_mxfp4_release_loads_its_dequantized_experts_exactly(tmp_path):
    """Read as floats, the experts are their dequantized values bit for bit and the logits transformers' on those
    values (device backend); kept MXFP4 (the host backend's default for such a checkpoint), every expert's packed
    weights hold the same values bit for bit and the native MXFP4 product gives the same logits within its
    int8-quantized activations."""
    from moe_jax.formats.checkpoint import open_checkpoint

    hf = make_hf_model("gpt_oss", seed=5, intermediate_size=32)
    release, dequantized = mxfp4_release(hf, tmp_path)
    checkpoint = open_checkpoint(release)
    assert checkpoint.shipped_quant() == "mxfp4"
    floats = checkpoint.layer_experts(1, np.dtype(np.float32))
    gate_up = dequantized["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(floats.w13, np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1))
    np.testing.assert_array_equal(floats.w2, dequantized["model.layers.1.mlp.experts.down_proj"])
    packed, as_stored = checkpoint.quantized_layer(1, "mxfp4", np.dtype(np.float32))
    assert as_stored and packed.quant == "mxfp4"
    for e in range(packed.num_experts):
        w13, w2 = packed.dequantized(e)
        np.testing.assert_array_equal(w13, floats.w13[e])
        np.testing.assert_array_equal(w2, floats.w2[e])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(torch.from_numpy(dequantized[name]))
    reference = hf_logits(hf, IDS)
    np.testing.assert_allclose(moe_jax.load_model(release, backend="device").logits(IDS), reference, atol=1e-4, rtol=0)
    host = moe_jax.load_model(release, backend="host")
    assert host.plan.quant == "mxfp4" and host.dtype == "float32"
    assert np.abs(host.logits(IDS) - reference).max() < 0.03 * np.abs(reference).max()


def test_gguf_mxfp4_file_gives_the_safetensors_releases_logits(tmp_path):
    """The same weights as a GGUF file with MXFP4 experts (llama.cpp's block layout: the scale byte first, values
    j and j + 16 sharing a byte) and as an MXFP4 safetensors release: the same codes in the store, bit for bit, and
    the same logits, whether read as floats or kept MXFP4."""
    from moe_jax.formats.checkpoint import open_checkpoint
    from tests.gguf_files import write_gguf
    from tests.test_gguf import FAMILIES

    hf = make_hf_model("gpt_oss", seed=5, intermediate_size=32, **FAMILIES["gpt_oss"])
    release, _ = mxfp4_release(hf, tmp_path)
    gguf_file = write_gguf(hf, tmp_path / "model.gguf", experts="MXFP4")
    from_gguf, _ = open_checkpoint(gguf_file).quantized_layer(0, "mxfp4", np.dtype(np.float32))
    from_release, _ = open_checkpoint(release).quantized_layer(0, "mxfp4", np.dtype(np.float32))
    np.testing.assert_array_equal(from_gguf.w13_packed, from_release.w13_packed)
    np.testing.assert_array_equal(from_gguf.w2_packed, from_release.w2_packed)
    for quant in ("mxfp4", None):
        kwargs = dict(backend="host", dtype="float32") if quant else dict(backend="device", dtype="float32")
        ours = moe_jax.load_model(gguf_file, **kwargs).logits(IDS)
        np.testing.assert_allclose(ours, moe_jax.load_model(release, **kwargs).logits(IDS), atol=1e-5, rtol=0)


def test_converted_and_quantized_stores_keep_the_biases(gpt_oss, tmp_path):
    """`moe-jax convert` keeps the experts' biases beside the store (they are dense tensors); an int8 store's
    fused forward adds them to its quantized products."""
    from moe_jax import convert

    hf, path = gpt_oss
    reference = hf_logits(hf, IDS)
    convert.main(["--hf", str(path), "--out", str(tmp_path / "float")])
    np.testing.assert_allclose(moe_jax.load_model(tmp_path / "float").logits(IDS), reference, atol=1e-4, rtol=0)
    convert.main(["--hf", str(path), "--out", str(tmp_path / "int8"), "--quant", "int8"])
    int8 = moe_jax.load_model(tmp_path / "int8").logits(IDS)
    assert np.abs(int8 - reference).max() / np.abs(reference).max() < 0.05


def test_converting_an_mxfp4_release_keeps_its_experts_mxfp4(tmp_path):
    """`moe-jax convert` stores an MXFP4 release's experts MXFP4 by default (code for code): the converted model
    computes what the release does on the host."""
    import json

    from moe_jax import convert

    release, _ = mxfp4_release(make_hf_model("gpt_oss", seed=6, intermediate_size=32), tmp_path)
    convert.main(["--hf", str(release), "--out", str(tmp_path / "converted")])
    assert "quantization_config" not in json.loads((tmp_path / "converted" / "config.json").read_text())
    converted = moe_jax.load_model(tmp_path / "converted", backend="host")
    assert converted.plan.quant == "mxfp4"
    np.testing.assert_array_equal(converted.logits(IDS), moe_jax.load_model(release, backend="host").logits(IDS))


def test_advise_counts_a_release_as_it_loads_mxfp4_first(tmp_path):
    """`moe-jax advise` asks first what a load does by default: an MXFP4 release's experts kept MXFP4, fewer bytes
    than as floats."""
    from moe_jax.formats.checkpoint import open_checkpoint
    from moe_jax.planning.advise import host_memory_question

    release, _ = mxfp4_release(make_hf_model("gpt_oss", seed=6, intermediate_size=32), tmp_path)
    options = host_memory_question(open_checkpoint(release), "bfloat16", None)["options"]
    assert [o["quant"] for o in options[:4]] == ["mxfp4", None, "int8", "int4"]
    assert options[0]["bytes"] < options[1]["bytes"]
