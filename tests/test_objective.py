"""The fine-tuning loss against a float64 numpy reference: masked positions, the shift by one, its gradient."""

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.train.objective import causal_lm_loss


def reference_loss(logits, tokens, mask):
    """float64: mean over masked targets of -log softmax(logits[:, t])[tokens[:, t + 1]]."""
    x = logits[:, :-1].astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:].astype(np.float64)
    return -(picked * m).sum() / max(m.sum(), 1.0)


def test_loss_and_gradient_follow_the_reference():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 7, 13)) * 4).astype(np.float32)
    tokens = rng.integers(0, 13, size=(2, 7)).astype(np.int32)
    mask = np.array([[0, 0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 0]], np.int32)  # prompt, gap; the last masked
    loss = float(causal_lm_loss(jnp.asarray(logits), tokens, mask))
    np.testing.assert_allclose(loss, reference_loss(logits, tokens, mask), rtol=1e-6)

    # the gradient: (softmax - one-hot of the target) / targets at masked positions, zero elsewhere and at the
    # last position (it predicts nothing)
    grad = np.asarray(jax.grad(causal_lm_loss)(jnp.asarray(logits), tokens, mask))
    x = logits[:, :-1].astype(np.float64)
    soft = np.exp(x - x.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    soft[np.arange(2)[:, None], np.arange(6)[None], tokens[:, 1:]] -= 1.0
    expected = np.zeros_like(logits, np.float64)
    expected[:, :-1] = soft * mask[:, 1:, None] / mask[:, 1:].sum()
    np.testing.assert_allclose(grad, expected, atol=1e-7)


def test_no_target_gives_zero_not_nan():
    logits = jnp.ones((1, 4, 5))
    tokens = np.zeros((1, 4), np.int32)
    assert float(causal_lm_loss(logits, tokens, np.zeros((1, 4), np.int32))) == 0.0
    assert float(causal_lm_loss(logits, tokens, np.array([[1, 0, 0, 0]]))) == 0.0  # only the first: not a target
