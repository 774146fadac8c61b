"""Greedy generation equals transformers' generate; a prompt's output does not depend on its batch."""

import pytest

import moe_jax
from tests.hf_models import make_hf_model, save_hf_model, torch


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def pair(request, tmp_path_factory):
    hf = make_hf_model(request.param, seed=7)
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(hf, path)
    return hf, moe_jax.load_model(path, backend="device")


PROMPTS = [[5, 17, 33, 2, 9], [40, 41], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(pair):
    hf, model = pair
    for prompt in PROMPTS:
        assert model.generate([prompt], max_new_tokens=8) == [hf_greedy(hf, prompt, 8)]


@pytest.mark.parametrize("variant", ["glm4_moe", "olmoe", "minimax_m2", "qwen3_next"])
def test_greedy_matches_transformers_for_more_families(variant, tmp_path):
    """The other issue-18 families, greedy only (the fixture's four cover batching and sampling)."""
    # OLMoE's default pad token is 1, which transformers' generate would mask out of the prompt [1, 2, ...]
    hf = make_hf_model(variant, seed=7, pad_token_id=0)
    model = moe_jax.load_model(save_hf_model(hf, tmp_path), backend="host")
    assert model.generate(PROMPTS, max_new_tokens=8) == [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_batch_equals_alone(pair):
    _, model = pair
    alone = [model.generate([p], max_new_tokens=6)[0] for p in PROMPTS]
    assert model.generate(PROMPTS, max_new_tokens=6) == alone


def test_sampling_is_seeded_and_valid(pair):
    _, model = pair
    a = model.generate(PROMPTS, max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3)
    b = model.generate(PROMPTS, max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3)
    assert a == b and all(len(o) == 5 and all(0 <= t < 96 for t in o) for o in a)


@pytest.mark.parametrize("kwargs, message", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p")])
def test_bad_sampling_settings(pair, kwargs, message):
    _, model = pair
    with pytest.raises(moe_jax.InputError, match=message):
        model.generate(PROMPTS, max_new_tokens=2, **kwargs)
