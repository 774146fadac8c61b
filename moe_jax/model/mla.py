"""DeepSeek's multi-head latent attention (MLA), as transformers' `deepseek_v2` / `deepseek_v3` compute it.

How it works and why: docs/INTERNALS.md, moe_jax/model/mla.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.config import MLA
from moe_jax.model.layers import Projection, RMSNorm, attend, chunked_causal_attention, write_positions
from moe_jax.model.rope import Rope
from moe_jax.model.sparse_indexer import LightningIndexer

# steps of up to this many tokens a row over the cache (decode, a speculative step's token and drafts) take the
# absorbed form, as many queries as that against the compressed cache; prefill pieces (wider) the expanded one
ABSORBED_TOKENS = 16


class MLAttention(nnx.Module):
    def __init__(
        self,
        *,
        q_proj: Projection | None,
        q_a_proj: Projection | None,
        q_a_layernorm: RMSNorm | None,
        q_b_proj: Projection | None,
        kv_a_proj_with_mqa: Projection,
        kv_a_layernorm: RMSNorm,
        kv_b_proj: Projection,
        o_proj: Projection,
        num_heads: int,
        mla: MLA,
        rope: Rope,
        scale: float,
        absorbed_decode: bool = True,
        indexer: LightningIndexer | None = None,
    ):
        # attribute names are Hugging Face's module names (LoRA targets and PEFT export use them)
        self.q_proj, self.q_a_proj, self.q_a_layernorm, self.q_b_proj = q_proj, q_a_proj, q_a_layernorm, q_b_proj
        self.kv_a_proj_with_mqa, self.kv_a_layernorm, self.kv_b_proj = kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
        self.o_proj = o_proj
        self.num_heads, self.mla, self.rope, self.scale = num_heads, mla, rope, scale
        self.absorbed_decode = absorbed_decode
        self.indexer = indexer

    def __call__(self, x_btd, positions_bt, cache=None):
        """Returns (output [b, t, d], updated cache); `cache` is (latent [b, 1, s, r], rotary key [b, 1, s, p]) and
        with an indexer its keys [b, 1, s, index_head_dim]."""
        b, t, _ = x_btd.shape
        m, h = self.mla, self.num_heads
        if self.q_proj is not None:
            q_latent, q = None, self.q_proj(x_btd)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x_btd))
            q = self.q_b_proj(q_latent)
        q = q.reshape(b, t, h, m.qk_dim)
        compressed = self.kv_a_proj_with_mqa(x_btd)
        latent_btr = self.kv_a_layernorm(compressed[..., : m.kv_lora_rank])
        cos, sin = self.rope.cos_sin(positions_bt)
        q_rope = self.rope.apply(q[..., m.nope_dim :], cos[:, :, None], sin[:, :, None])
        q = jnp.concatenate([q[..., : m.nope_dim], q_rope], axis=-1)
        k_rope_btp = self.rope.apply(compressed[..., m.kv_lora_rank :], cos, sin)

        index_keys_btk = self.indexer.keys(x_btd, cos, sin) if self.indexer is not None else None
        if cache is None:
            chosen = self._sparse_choice(x_btd, q_latent, cos, sin, index_keys_btk, positions_bt, positions_bt)
            out = self._expanded(q, latent_btr, k_rope_btp, positions_bt, positions_bt, True, chosen)
        else:
            key_pos_bs = jnp.broadcast_to(jnp.arange(cache[0].shape[2]), (b, cache[0].shape[2]))
            new_entries = (latent_btr, k_rope_btp) + ((index_keys_btk,) if self.indexer is not None else ())
            cache = tuple(
                write_positions(old, new[:, None], positions_bt, key_pos_bs)
                for old, new in zip(cache, new_entries, strict=True)
            )
            latent_bsr, rope_bsp = cache[0][:, 0].astype(q.dtype), cache[1][:, 0].astype(q.dtype)
            index_keys_bsk = cache[2][:, 0] if self.indexer is not None else None
            chosen = self._sparse_choice(x_btd, q_latent, cos, sin, index_keys_bsk, positions_bt, key_pos_bs)
            if t <= ABSORBED_TOKENS and self.absorbed_decode:
                out = self._absorbed(q, latent_bsr, rope_bsp, positions_bt, key_pos_bs, chosen)
            else:
                out = self._expanded(q, latent_bsr, rope_bsp, positions_bt, key_pos_bs, False, chosen)
        return self.o_proj(out.reshape(b, t, h * m.v_dim)), cache

    def _sparse_choice(self, x_btd, q_latent_btr, cos, sin, index_keys_bsk, q_pos_bt, k_pos_bs):
        """The keys the indexer lets each query attend to [b, t, s], or None where attention is dense: no indexer, or
        one whose top-k takes every key there is (no scoring then)."""
        if self.indexer is None or self.indexer.spec.top_k >= index_keys_bsk.shape[1]:
            return None
        causal_bts = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
        return self.indexer.selection(x_btd, q_latent_btr, cos, sin, index_keys_bsk, causal_bts)

    def _expanded(self, q_bthd, latent_bsr, rope_bsp, q_pos_bt, k_pos_bs, causal_chunks: bool, chosen_bts=None):
        """Attention with per-head keys and values multiplied out of the latent: [b, t, h, v_dim]."""
        m, h = self.mla, self.num_heads
        b, s = latent_bsr.shape[:2]
        kv = self.kv_b_proj(latent_bsr).reshape(b, s, h, m.nope_dim + m.v_dim)
        k_rope = jnp.broadcast_to(rope_bsp[:, :, None], (b, s, h, m.rope_dim))
        k_bhsd = jnp.concatenate([kv[..., : m.nope_dim], k_rope], axis=-1).transpose(0, 2, 1, 3)
        v_bhsd = kv[..., m.nope_dim :].transpose(0, 2, 1, 3)
        q_bht1d = q_bthd.transpose(0, 2, 1, 3)[:, :, :, None]  # every head its own kv head: group of 1
        if causal_chunks:
            out = chunked_causal_attention(q_bht1d, k_bhsd, v_bhsd, q_pos_bt, None, self.scale, key_mask=chosen_bts)
        else:
            out = attend(q_bht1d, k_bhsd, v_bhsd, q_pos_bt, k_pos_bs, None, self.scale, key_mask=chosen_bts)
        return out[:, :, :, 0].transpose(0, 2, 1, 3)

    def _absorbed(self, q_bthd, latent_bsr, rope_bsp, q_pos_bt, k_pos_bs, chosen_bts=None):
        """A few queries per row (a decode step's one, a speculative step's token and drafts) against the
        compressed cache: [b, t, h, v_dim]. The t queries and heads are one axis of rows, so each query's products
        are those of a one-token step."""
        m, h = self.mla, self.num_heads
        b, t = q_bthd.shape[:2]
        w = self.kv_b_proj.merged_weight().astype(q_bthd.dtype).reshape(m.kv_lora_rank, h, m.nope_dim + m.v_dim)
        w_uk_rhn, w_uv_rhv = w[..., : m.nope_dim], w[..., m.nope_dim :]
        q = q_bthd.reshape(b * t, h, m.qk_dim)
        f32 = jnp.float32
        q_latent_bhr = jnp.einsum("bhn,rhn->bhr", q[..., : m.nope_dim], w_uk_rhn, preferred_element_type=f32)
        served = self._served_absorbed(b, t)
        if served is not None:
            q_latent_bhr += served.query(q[..., : m.nope_dim])
        q_latent_bmr = q_latent_bhr.astype(q.dtype).reshape(b, t * h, m.kv_lora_rank)
        scores = jnp.einsum("bmr,bsr->bms", q_latent_bmr, latent_bsr, preferred_element_type=f32)
        q_rope_bmp = q[..., m.nope_dim :].reshape(b, t * h, m.rope_dim)
        scores += jnp.einsum("bmp,bsp->bms", q_rope_bmp, rope_bsp, preferred_element_type=f32)
        allowed = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]  # [b, t, s]
        if chosen_bts is not None:
            allowed &= chosen_bts
        allowed = jnp.repeat(allowed, h, axis=1)  # [b, t * h, s]: query-major, as the rows
        scores = jnp.where(allowed, scores * self.scale, jnp.finfo(f32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        context_bmr = jnp.einsum("bms,bsr->bmr", probs, latent_bsr, preferred_element_type=f32).astype(q.dtype)
        context_bhr = context_bmr.reshape(b * t, h, m.kv_lora_rank)
        out = jnp.einsum("bhr,rhv->bhv", context_bhr, w_uv_rhv, preferred_element_type=f32)
        if served is not None:
            out += served.output(context_bhr)
        return out.astype(q.dtype).reshape(b, t, h, m.v_dim)

    def _served_absorbed(self, rows: int, tokens: int):
        """The rows' per-request adapters on kv_b_proj in the absorbed form, each row's repeated for its `tokens`
        queries, or None (none served, or none chosen in this step)."""
        served = self.kv_b_proj.served
        weights = served.row_weights((rows,)) if served is not None else None
        if weights is None:
            return None
        m = self.mla
        b_jhd = served.b[...].reshape(-1, self.num_heads, m.nope_dim + m.v_dim)
        mask_bj, scale_b = (jnp.repeat(x, tokens, axis=0) for x in weights)
        return AbsorbedAdapters(served.a[...], b_jhd[..., : m.nope_dim], b_jhd[..., m.nope_dim :], mask_bj, scale_b)


class AbsorbedAdapters(NamedTuple):
    """Per-request adapters on kv_b_proj (W [latent, heads x (nope + v)] += A @ B, A [latent, R]) in the absorbed
    decode: the query's latent gains q . (A @ B_uk) and the output ctx . (A @ B_uv), each row through its own
    adapter's columns (`ServedLoRA.row_weights`), without forming any row's W."""

    a_rj: jax.Array
    b_uk_jhn: jax.Array
    b_uv_jhv: jax.Array
    mask_bj: jax.Array
    scale_b: jax.Array

    def _weighted(self, t_bhj):
        return t_bhj * (self.mask_bj * self.scale_b[:, None])[:, None, :]

    def query(self, q_nope_bhn):
        t = jnp.einsum("bhn,jhn->bhj", q_nope_bhn.astype(jnp.float32), self.b_uk_jhn)
        return jnp.einsum("bhj,rj->bhr", self._weighted(t), self.a_rj)

    def output(self, context_bhr):
        t = jnp.einsum("bhr,rj->bhj", context_bhr.astype(jnp.float32), self.a_rj)
        return jnp.einsum("bhj,jhv->bhv", self._weighted(t), self.b_uv_jhv)
