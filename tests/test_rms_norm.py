"""RMSNorm's hand-written gradient (model/layers.rms_norm) against automatic differentiation of the same formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.model.layers import rms_norm


def plain_rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gradients_follow_automatic_differentiation(dtype, tol):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 16)) * 3, dtype)  # [b, t, heads, head dim]: a q_norm's shape
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(16), dtype)
    probe = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def loss(norm, x, weight):
        return jnp.sum(norm(x, weight, 1e-6).astype(jnp.float32) * probe)

    np.testing.assert_array_equal(rms_norm(x, weight, 1e-6), plain_rms_norm(x, weight, 1e-6))  # same forward
    got = jax.grad(lambda x, w: loss(rms_norm, x, w), argnums=(0, 1))(x, weight)
    want = jax.grad(lambda x, w: loss(plain_rms_norm, x, w), argnums=(0, 1))(x, weight)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())
