"""The host sampler: its settings' edges, and its draws equal to a full-vocabulary sort and Generator.choice."""

import numpy as np
import pytest

from moe_jax.errors import MoeJaxError
from moe_jax.generation.sampling import sample


def sorted_reference(logits_bv, rng, temperature, top_p, top_k):
    """The textbook sampler: sorts the whole vocabulary for top-k and top-p, then Generator.choice over it."""
    z = logits_bv.astype(np.float64)
    z = (z - z.max(axis=-1, keepdims=True)) / temperature
    if top_k and top_k < z.shape[-1]:
        z = np.where(z < np.sort(z, axis=-1)[:, -top_k][:, None], -np.inf, z)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        drop = np.zeros_like(probs, bool)
        np.put_along_axis(drop, order, np.cumsum(ranked, axis=-1) - ranked >= top_p, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=p) for p in probs])


@pytest.mark.parametrize("vocab", [7, 300, 32000])
@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.95, 40), (0.5, 1.0, 3), (2.0, 0.5, 0), (4.0, 0.999, 0), (1.0, 0.9, 1)],
)
def test_draws_equal_a_full_sort(vocab, temperature, top_p, top_k):
    logits_rng = np.random.default_rng(vocab)
    for scale in (0.3, 3.0, 12.0):  # flat (nucleus wider than the first window) to peaked
        logits = (logits_rng.standard_normal((3, vocab)) * scale).astype(np.float32)
        logits[0, : vocab // 2] = logits[0, 0]  # ties, also at the k-th value and inside the nucleus
        ours, theirs = np.random.default_rng(11), np.random.default_rng(11)
        drawn = [sample(logits, ours, temperature, top_p, top_k).tolist() for _ in range(8)]
        assert drawn == [sorted_reference(logits, theirs, temperature, top_p, top_k).tolist() for _ in range(8)]


@pytest.mark.parametrize("vocab", [1 << 15, 1 << 17])  # probabilities below the first floor, and the second
def test_a_nucleus_of_improbable_tokens(vocab):
    logits = np.zeros((1, vocab), np.float32)  # uniform: top_p 0.5 keeps exactly the first half by token order
    rng = np.random.default_rng(0)
    drawn = [int(sample(logits, rng, 1.0, 0.5)[0]) for _ in range(2000)]
    assert 0.95 * vocab // 2 < max(drawn) < vocab // 2 and min(drawn) < vocab // 20  # (not missing either end)


def test_sampling_top_p_keeps_nucleus():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    rng = np.random.default_rng(0)
    drawn = {int(sample(logits, rng, 1.0, 0.7)[0]) for _ in range(200)}
    assert drawn == {0, 1}


def test_sampler_edge_settings():
    logits = np.array([[0.5, 3.0, -1.0, 2.9]], np.float32)
    rng = np.random.default_rng(0)
    assert [int(sample(logits, rng, 1e-300, 1.0)[0]) for _ in range(20)] == [1] * 20  # not NaN probabilities
    drawn = {int(sample(logits, rng, 5.0, 1.0, top_k=50)[0]) for _ in range(300)}  # top-k above the vocabulary
    assert drawn == {0, 1, 2, 3}
    assert {int(sample(logits, rng, 5.0, 1.0, top_k=2)[0]) for _ in range(300)} == {1, 3}
    assert sample(logits, rng, 0.0, 0.5, top_k=2).tolist() == [1]  # temperature 0: argmax, settings aside


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_logits_that_are_not_finite_are_named(bad):
    logits = np.array([[0.5, bad, 1.0]], np.float32)
    with pytest.raises(MoeJaxError, match="NaN or inf"):
        sample(logits, np.random.default_rng(0), 1.0, 0.9)


def test_logit_bias_and_penalties_as_openai_defines_them():
    from moe_jax.generation.batch import Sampling
    from moe_jax.generation.sampling import adjusted_logits

    logits = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    sampling = Sampling(logit_bias=((0, 5.0), (3, -1.5)), presence_penalty=0.5, frequency_penalty=0.25)
    got = adjusted_logits(logits, sampling, [2, 2, 1, 2])
    # token 2: generated 3 times (0.5 + 3 x 0.25 off); token 1: once (0.5 + 0.25 off); biases on 0 and 3
    np.testing.assert_allclose(got, [6.0, 2.0 - 0.75, 3.0 - 1.25, 2.5])
    np.testing.assert_array_equal(logits, [1.0, 2.0, 3.0, 4.0])  # the step's logits are left as they are
    assert not Sampling(temperature=0).adjusts and Sampling(temperature=0).greedy
    assert not Sampling(temperature=0, presence_penalty=0.1).greedy  # chosen on the host from adjusted logits
