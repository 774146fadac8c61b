"""DeepSeek-V3.2: latent attention made sparse by the lightning indexer, against transformers: the sparse function
(each query attends to its index_topk = 6 best-scored tokens past 6 tokens, not dense attention under its name), in
generation (the indexer's keys cached beside the latent; both decode forms, a prompt longer than a prefill chunk),
in the KV accounting and the anchor cache."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.generation.anchor_cache import AnchorCache
from moe_jax.generation.engine import PREFILL_CHUNK, GenerationEngine, Request
from moe_jax.generation.generate import generate_tokens
from moe_jax.model.sparse_indexer import top_k_mask
from tests.hf_models import hf_logits, make_hf_model, save_hf_model, torch

TOP_K = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_model("deepseek_v32", seed=3, max_position_embeddings=512)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("deepseek_v32"))


def dense_twin(hf):
    """The same transformers model with every indexer choosing all tokens: dense MLA."""
    dense = copy.deepcopy(hf)
    for layer in dense.model.layers:
        layer.self_attn.indexer.index_topk = 10**6
    return dense


def test_long_context_is_the_sparse_function_short_context_dense_mla(pair):
    hf, path = pair
    model = moe_jax.load_model(path, backend="device")
    assert model.config.mla.indexer.top_k == TOP_K and model.config.dense_layers == (1,)
    ids = np.random.default_rng(1).integers(0, 96, size=(2, 40))
    ours, sparse, dense = model.logits(ids), hf_logits(hf, ids), hf_logits(dense_twin(hf), ids)
    np.testing.assert_allclose(ours, sparse, atol=1e-4, rtol=0)
    # up to the TOP_K-th token every query sees all it may: the functions agree there, and part after
    np.testing.assert_allclose(sparse[:, :TOP_K], dense[:, :TOP_K], atol=1e-5, rtol=0)
    assert np.abs(ours[:, TOP_K + 4 :] - dense[:, TOP_K + 4 :]).max() > 0.1


def test_bfloat16_within_its_rounding(pair):
    hf, path = pair
    model = moe_jax.load_model(path, backend="device", dtype="bfloat16")
    ids = np.random.default_rng(2).integers(0, 96, size=(2, 24))
    theirs = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    exact = hf_logits(hf, ids)
    ours = model.logits(ids)
    # as far from float32 as transformers' bfloat16 is (the sparse choice may differ where scores nearly tie)
    assert np.abs(ours - exact).max() <= 2 * max(np.abs(theirs - exact).max(), 0.02 * np.abs(exact).max())


def test_top_k_mask_keeps_exactly_the_best_allowed_keys():
    rng = np.random.default_rng(0)
    b, t, s, k = 2, 9, 14, 4
    scores = jnp.asarray(rng.normal(size=(b, t, s)), jnp.float32)
    allowed = jnp.asarray(np.arange(s)[None, None, :] <= np.arange(t)[None, :, None] + 3).repeat(b, 0)
    chosen = np.asarray(top_k_mask(scores, allowed, k))
    for row in range(b):
        for q in range(t):
            visible = np.flatnonzero(np.asarray(allowed[row, q]))
            best = visible[np.argsort(-np.asarray(scores[row, q, visible]))[:k]]
            assert sorted(np.flatnonzero(chosen[row, q])) == sorted(best)
    assert chosen.sum(-1).max() == k and chosen.sum(-1).min() == 4  # the first query sees exactly 4


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_greedy_generation_matches_transformers(pair, form):
    """Ragged prompts in shared prefill steps, one longer than a prefill chunk (its later chunks choose among the
    cached indexer keys), decode steps over the cache in either form, two slots serving four prompts."""
    hf, path = pair
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 96, size=n).tolist() for n in (4, PREFILL_CHUNK + 30, 17, 9)]
    model = moe_jax.load_model(path, backend="host", mla_decode=form)
    completions = generate_tokens(model, prompts, 6, temperature=0.0, top_p=1.0, seed=0, slots=2)
    assert [c.tokens for c in completions] == [hf_greedy(hf, p, 6) for p in prompts]


def test_cache_holds_the_indexer_keys(pair):
    _, path = pair
    model = moe_jax.load_model(path, backend="device")
    mla = model.config.mla
    for latent, rope_key, index_key in model.kv.new_caches(2, 20):
        assert latent.shape == (2, 1, 20, mla.kv_lora_rank) and rope_key.shape == (2, 1, 20, mla.rope_dim)
        assert index_key.shape == (2, 1, 20, mla.indexer.head_dim)
    per_token = mla.kv_lora_rank + mla.rope_dim + mla.indexer.head_dim
    assert model.kv.bytes_per_sequence(20) == model.config.num_layers * 20 * per_token * 4


def test_anchor_cache_resumes_with_the_indexer_keys(pair):
    _, path = pair
    model = moe_jax.load_model(path, backend="device")
    anchor = 7
    rng = np.random.default_rng(3)
    first = rng.integers(8, 96, size=10).tolist() + [anchor] + rng.integers(8, 96, size=4).tolist() + [anchor]
    second = first + rng.integers(8, 96, size=9).tolist()
    cache = AnchorCache([anchor], budget_bytes=1 << 20)
    prompts = [first + [3], second]
    with_cache = [GenerationEngine(model, 1, 64, cache).run([Request(p, 6)])[0] for p in prompts]
    without = [GenerationEngine(model, 1, 64).run([Request(p, 6)])[0] for p in prompts]
    assert [c.tokens for c in with_cache] == [c.tokens for c in without]
    assert [c.reused_tokens for c in with_cache] == [0, len(first)]
    _, prefix = cache.lookup(second)
    assert all(entry[2].shape == (len(first), 1, model.config.mla.indexer.head_dim) for entry in prefix)
