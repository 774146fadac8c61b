"""Qwen3-Next: Gated DeltaNet layers beside gated attention, against transformers (float32, float64, bfloat16), in
generation (its recurrent state in the cache: ragged prompts, chunked prefill, reused slots), in the KV accounting
and under LoRA training."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.generation.anchor_cache import AnchorCache
from moe_jax.generation.engine import PREFILL_CHUNK, GenerationEngine, Request
from moe_jax.generation.generate import generate_tokens
from moe_jax.generation.prefill_pieces import piece, piece_ends
from moe_jax.model.delta_net import gated_delta_rule
from moe_jax.model.lora import LoRAConfig, split_trainable
from tests.hf_models import hf_logits, make_hf_model, save_hf_model, torch
from tests.test_backends import lora_loss_grad


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_model("qwen3_next", seed=3, pad_token_id=0, max_position_embeddings=512)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3_next"))


def test_long_sequences_follow_float64_across_chunks(pair):
    """150 tokens: three DeltaNet chunks carried by the scan. Compared with transformers in float64, since its float32
    run is itself ~1e-3 away there (the tiny random model decays and amplifies strongly): ours at least as close."""
    hf, path = pair
    model = moe_jax.load_model(path, backend="device")
    ids = np.random.default_rng(5).integers(0, 96, size=(2, 150))
    hf64 = copy.deepcopy(hf).double()
    hf64.config._experts_implementation = "eager"  # its grouped product has no float64
    with torch.no_grad():
        truth = hf64(torch.as_tensor(ids)).logits.numpy()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)).logits.numpy()
    error, their_error = np.abs(model.logits(ids) - truth).max(), np.abs(theirs - truth).max()
    assert error <= min(their_error, 1e-3), (error, their_error)


def test_chunked_rule_equals_the_recurrent_one():
    """The chunked form (with a state carried in, a length that is no multiple of the chunk) against the token by
    token recurrence it condenses, in float64-free float32 arithmetic on both sides."""
    rng = np.random.default_rng(0)
    b, t, hk, hv, dk, dv = 2, 37, 2, 4, 8, 6
    q, k = (jnp.asarray(rng.normal(size=(b, t, hk, dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(b, t, hv, dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 0.5, size=(b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, size=(b, t, hv)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
    out, final = gated_delta_rule(q, k, v, g, beta, state, chunk=16)
    s, outs = state, []
    for i in range(t):
        step = slice(i, i + 1)
        o, s = gated_delta_rule(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], s)
        outs.append(o)
    np.testing.assert_allclose(out, jnp.concatenate(outs, axis=1), atol=2e-5)
    np.testing.assert_allclose(final, s, atol=2e-5)


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def test_greedy_generation_matches_transformers(pair):
    """Ragged prompts share prefill steps (their padding must not reach the recurrent state), one is longer than a
    prefill chunk (its state carried from chunk to chunk), and two slots serve four prompts (a reused slot's state
    must not leak into the next prompt)."""
    hf, path = pair
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 96, size=n).tolist() for n in (5, PREFILL_CHUNK + 40, 17, 2)]
    model = moe_jax.load_model(path, backend="host")
    completions = generate_tokens(model, prompts, 6, temperature=0.0, top_p=1.0, seed=0, slots=2)
    assert [c.tokens for c in completions] == [hf_greedy(hf, p, 6) for p in prompts]


def test_recurrent_state_is_counted_by_the_kv_accounting(pair):
    _, path = pair
    model = moe_jax.load_model(path, backend="device")
    c = model.config
    s, length = c.linear_attention, 64
    kv = 2 * c.num_kv_heads * c.head_dim * length * 4  # float32 keys and values
    state = (s.conv_kernel - 1) * s.conv_dim * 4 + s.num_v_heads * s.k_head_dim * s.v_head_dim * 4
    assert (
        model.kv.bytes_per_sequence(length) == (c.num_layers - len(c.linear_layers)) * kv + len(c.linear_layers) * state
    )
    caches = model.kv.new_caches(3, length)
    assert caches[0][1].shape == (3, s.num_v_heads, s.k_head_dim, s.v_head_dim) and caches[0][1].dtype == jnp.float32
    assert caches[3][0].shape == (3, c.num_kv_heads, length, c.head_dim)
    with model.kv.held(caches):
        assert model.kv.live_bytes == 3 * model.kv.bytes_per_sequence(length)


def hf_layer_parts(layer, x, cos_sin):
    """(token mixer output, MoE block output) of a transformers decoder layer on its input x."""
    normed = layer.input_layernorm(x)
    if layer.block_type == "linear_attention":
        mixed = layer.linear_attn(normed)
    else:
        mixed = layer.self_attn(normed, tuple(p.to(x.dtype) for p in cos_sin), None)[0]
    return mixed.float().numpy(), layer.mlp(layer.post_attention_layernorm(x)).float().numpy()


@pytest.mark.parametrize("layer", range(4))
def test_layers_in_bfloat16_follow_float32_as_transformers_bfloat16_does(pair, layer):
    """Each layer's token mixer (three DeltaNets, one gated attention) and MoE block in bfloat16, given its float32
    input rounded to bfloat16: as far from the float32 layer as transformers' bfloat16 layer is, within 2x. (The
    whole tiny model's bfloat16 logits are not compared: near-tie routing amplifies any rounding into expert flips;
    transformers' own bfloat16 logits are 9% away from its float32 ones.)"""
    hf, path = pair
    seen = {}
    target = hf.model.layers[layer]
    hook = target.register_forward_pre_hook(
        lambda m, a, k: seen.update(x=a[0] if a else k["hidden_states"]), with_kwargs=True
    )
    ids = np.random.default_rng(1).integers(0, 96, size=(3, 13))
    with torch.no_grad():
        hf(torch.as_tensor(ids))
        hook.remove()
        x = seen["x"]
        cos_sin = hf.model.rotary_emb(x, torch.arange(13)[None])
        truth = hf_layer_parts(target, x, cos_sin)
        theirs = hf_layer_parts(copy.deepcopy(target).to(torch.bfloat16), x.to(torch.bfloat16), cos_sin)
    model = moe_jax.load_model(path, backend="device", dtype="bfloat16")
    ours_layer = model.transformer.layers[layer]
    x_bf16 = jnp.asarray(x.numpy(), jnp.bfloat16)
    ours = (
        ours_layer.mixer(ours_layer.input_layernorm(x_bf16), jnp.broadcast_to(jnp.arange(13), (3, 13)))[0],
        ours_layer.mlp(ours_layer.post_attention_layernorm(x_bf16)),
    )
    for got, hf_bf16, want in zip(ours, theirs, truth, strict=True):
        error, hf_error = relative_error(got, want), relative_error(hf_bf16, want)
        assert error < 2 * hf_error + 1e-3, (error, hf_error)


def relative_error(got, truth):
    truth = np.asarray(truth, np.float64)
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.linalg.norm(got - truth) / np.linalg.norm(truth))


def test_deltanet_adapters_get_the_same_gradients_on_every_backend(pair):
    """`attention` covers the DeltaNet's projections; their LoRA gradients (through the chunked rule's triangular
    solve and scan) are non-zero and the same where the experts run on the host (to 3e-4 of the largest: the tiny
    model amplifies float32 rounding, the experts' summation order here, as its logits showed above)."""
    _, path = pair
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, size=(2, 80)))
    results = {}
    for backend in ("device", "host"):
        model = moe_jax.load_model(path, backend=backend)
        results[backend] = lora_loss_grad(model, tokens)
        assert {"in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj"} <= set(model.lora_config.targets)
    (loss, grads), (host_loss, host_grads) = results["device"], results["host"]
    flat = {"/".join(map(str, p)): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    deltanet = [g for name, g in flat.items() if "linear_attn" in name]
    assert len(deltanet) == 3 * 2 * 3  # three DeltaNet layers, three projections, A and B
    assert all(float(jnp.abs(g).max()) > 0 for g in deltanet)
    np.testing.assert_allclose(host_loss, loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(host_grads), jax.tree.leaves(grads), strict=True):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(got / scale, want / scale, atol=3e-4)


def test_anchor_cache_resumes_the_recurrent_state_exactly(pair):
    """Anchors save the DeltaNet state as of each anchor (the prefill ends a step there), so an appended turn and an
    edited one resume from their last cached anchor, alone and batched, with the outputs of no cache at all."""
    from tests.test_engine import ANCHOR, conversation

    _, path = pair
    model = moe_jax.load_model(path, backend="host")
    rng = np.random.default_rng(1)
    first = conversation(rng, [6, 5, 4])
    second = first + rng.integers(8, 96, size=5).tolist()  # a turn appended
    edited = first[:7] + rng.integers(8, 96, size=6).tolist() + [ANCHOR] + second[-5:]  # the second turn rewritten
    prompts = [first + [3], second, edited]

    def run(requests, cache=None):
        return GenerationEngine(model, len(requests), 96, cache).run(requests)

    without = [c.tokens for c in run([Request(p, 6) for p in prompts])]
    cache = AnchorCache([ANCHOR], budget_bytes=1 << 20)
    alone = [run([Request(p, 6)], cache)[0] for p in prompts]
    assert [c.tokens for c in alone] == without
    assert [c.reused_tokens for c in alone] == [0, len(first), 7]
    together = run([Request(p, 6) for p in prompts], cache)
    assert [c.tokens for c in together] == without
    assert [c.reused_tokens for c in together] == [len(first), len(first), 7 + 7]  # the edited turn is cached now


@pytest.mark.parametrize(
    "length, width, stops, ends",
    [
        (10, 4, [], [4, 8, 10]),
        (10, 4, [3, 9], [3, 7, 9, 10]),  # counted again from each stop
        (10, 16, [5, 5, 0, 10], [5, 10]),  # repeated and out-of-range stops ignored
    ],
)
def test_prefill_pieces_end_at_stops(length, width, stops, ends):
    assert piece_ends(length, width, stops) == ends
    assert [piece(ends, s) for s in range(len(ends) + 1)][-2:] == [(ends[-2], ends[-1]), (ends[-1], ends[-1])]


TINY_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
    temporal_patch_size=2, spatial_merge_size=2,
)  # fmt: skip


def test_qwen3_5_moe_multimodal_release_reads_its_language_model(tmp_path):
    """A Qwen3.5-MoE release is multimodal: its config nests the language model's in `text_config` and its weights
    sit under `model.language_model.` beside the vision tower's. moe_jax reads the language model: transformers'
    multimodal model's logits on text, and exports adapters under the names peft finds there."""
    peft = pytest.importorskip("peft")
    import transformers

    text = make_hf_model("qwen3_5_moe", seed=4)
    config = transformers.Qwen3_5MoeConfig(text_config=text.config.to_dict(), vision_config=TINY_VISION)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in text.state_dict().items()}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    path = save_hf_model(hf, tmp_path / "release")
    model = moe_jax.load_model(path, backend="host")
    assert model.config.model_type == "qwen3_5_moe" and not model.config.linear_attention.fused_projections
    ids = np.random.default_rng(2).integers(0, 96, size=(2, 11))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)

    from moe_jax.formats.adapters import export_peft

    model.attach_lora(LoRAConfig(rank=2, alpha=4.0, targets=("attention",)), seed=1)
    _, lora_state, _ = split_trainable(model.transformer)
    rng = np.random.default_rng(3)
    model.set_lora_state(jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype), lora_state))
    export_peft(model.transformer, model.lora_config, tmp_path / "adapter", str(path))
    theirs = hf_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval(), ids)
    np.testing.assert_allclose(model.logits(ids), theirs, atol=2e-4, rtol=0)


def test_unit_lower_inverse_is_the_inverse():
    """The chunked rule's forward substitution against numpy's inverse of I + the strictly lower triangle."""
    from moe_jax.model.delta_net import unit_lower_inverse

    a = np.random.default_rng(4).normal(0, 0.3, size=(3, 2, 64, 64)).astype(np.float32)
    want = np.linalg.inv(np.eye(64) + np.tril(a.astype(np.float64), -1))
    np.testing.assert_allclose(unit_lower_inverse(jnp.asarray(a)), want, atol=1e-5)
