"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention), as transformers' `deepseek_v32` computes it.

How it works and why: docs/INTERNALS.md, moe_jax/model/sparse_indexer.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.config import SparseIndexer
from moe_jax.model.layers import Frozen, Projection
from moe_jax.model.rope import Rope

LAYER_NORM_EPS = 1e-6  # transformers' k_norm (the config has no key for it)
HEAD_GROUP = 16  # indexer heads scored together


class LightningIndexer(nnx.Module):
    def __init__(
        self,
        wq_b: Projection,
        wk: Projection,
        k_norm_weight,
        k_norm_bias,
        weights_proj_dh,
        spec: SparseIndexer,
        rope: Rope,
    ):
        # attribute names are Hugging Face's module names (the checkpoint's tensors)
        self.wq_b, self.wk = wq_b, wk
        self.k_norm_weight, self.k_norm_bias = Frozen(k_norm_weight), Frozen(k_norm_bias)
        self.weights_proj = Frozen(weights_proj_dh.astype(jnp.float32))  # float32, as transformers keeps it
        self.spec = spec
        self.rope = dataclasses.replace(rope, interleave=False)

    def keys(self, x_btd, cos, sin):
        """Each token's indexer key [b, t, head_dim], in x's dtype (what a generation cache holds)."""
        k = _layer_norm(self.wk(x_btd), self.k_norm_weight[...], self.k_norm_bias[...])
        return self.rope.apply(k, cos, sin)

    def selection(self, x_btd, q_latent_btr, cos, sin, keys_bsd, allowed_bts):
        """[b, t, s] booleans: the keys each query attends to, among those `allowed_bts` lets it see."""
        b, t, _ = x_btd.shape
        s = self.spec
        q = self.wq_b(q_latent_btr).reshape(b, t, s.num_heads, s.head_dim)
        q = self.rope.apply(q, cos[:, :, None], sin[:, :, None])
        f32 = jnp.float32
        q, keys_bsd = q.astype(f32), keys_bsd.astype(f32)
        weights = jnp.einsum("btd,dh->bth", x_btd.astype(f32), self.weights_proj[...], precision="highest")
        weights = weights * s.num_heads**-0.5
        # a few heads at a time: all heads' scores at once would be one [b, t, heads, s] float32 array, 64 heads
        # over a long cache for every query of a prefill step
        index_bts = 0.0
        for h in range(0, s.num_heads, HEAD_GROUP):
            group = slice(h, h + HEAD_GROUP)
            scores = jnp.einsum("bthd,bsd->bths", q[:, :, group], keys_bsd, precision="highest")
            scores = jax.nn.relu(scores * s.head_dim**-0.5)
            index_bts += jnp.einsum("bth,bths->bts", weights[:, :, group], scores, precision="highest")
        return jax.lax.stop_gradient(top_k_mask(index_bts, allowed_bts, s.top_k))


def top_k_mask(scores_bts, allowed_bts, k: int):
    """The `k` best-scored allowed keys of each query (all allowed ones where fewer): [b, t, s] booleans. Disallowed
    keys score lowest, so they are chosen only where fewer than k are allowed, and then dropped by `allowed`."""
    if k >= scores_bts.shape[-1]:
        return allowed_bts
    lowest = jnp.finfo(scores_bts.dtype).min
    _, chosen = jax.lax.top_k(jnp.where(allowed_bts, scores_bts, lowest), k)  # ties: the earlier key
    hit = jnp.zeros(scores_bts.shape, jnp.bool_)
    rows = jnp.arange(scores_bts.shape[0])[:, None, None]
    queries = jnp.arange(scores_bts.shape[1])[None, :, None]
    return hit.at[rows, queries, chosen].set(True) & allowed_bts


def _layer_norm(x, weight, bias):
    """torch's LayerNorm on a CPU: in float32 throughout, the affine part included, rounded once to x's dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
