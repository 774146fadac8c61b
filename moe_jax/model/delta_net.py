"""Gated DeltaNet: Qwen3-Next's linear attention, as transformers computes it (`Qwen3NextGatedDeltaNet`).

How it works and why: docs/INTERNALS.md, moe_jax/model/delta_net.py.
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.config import LinearAttention
from moe_jax.model.layers import Frozen, _normalized, _set_while, micro_batch_slice

# the input projections by Hugging Face name: Qwen3-Next's fused ones, Qwen3.5's apart
DELTA_NET_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")
DELTA_NET_SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

CHUNK = 64  # transformers' chunk size (the algorithm's result does not depend on it beyond rounding)
_HIGHEST = jax.lax.Precision.HIGHEST  # an accelerator's default float32 product (TF32) would round the state

# While a prefill step is traced (generation/engine.py): how many of each row's positions are real tokens (the
# rest is right padding, which must not reach the recurrent state). None: every position is real.
_TOKEN_COUNTS: contextvars.ContextVar = contextvars.ContextVar("prompt_token_counts", default=None)


def prompt_token_counts(counts_b):
    return _set_while(_TOKEN_COUNTS, counts_b)


def input_projections(spec: LinearAttention) -> tuple[str, ...]:
    """The input projections of a DeltaNet of this layout, by Hugging Face name."""
    return DELTA_NET_PROJECTIONS if spec.fused_projections else DELTA_NET_SPLIT_PROJECTIONS


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each head's output, scaled by silu(z): transformers' Qwen3NextRMSNormGated."""

    def __init__(self, weight, eps: float):
        self.weight = Frozen(weight)
        self.eps = eps

    def __call__(self, x, z):
        y = self.weight[...] * _normalized(x, self.eps).astype(x.dtype)
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, projections: dict, conv_weight, dt_bias, a_log, norm: GatedRMSNorm, out_proj, *, spec):
        """`projections` by Hugging Face name: Qwen3-Next's in_proj_qkvz and in_proj_ba (per key head its queries,
        keys, values and z, then its betas and decay inputs), or Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and
        in_proj_a; `conv_weight` [channels, 1, kernel] as torch's."""
        for name, projection in projections.items():
            setattr(self, name, projection)
        self.out_proj = out_proj
        self.conv_weight = Frozen(conv_weight[:, 0].T)  # [kernel, channels]
        self.dt_bias = Frozen(dt_bias)
        self.A_log = Frozen(a_log)
        self.norm = norm
        self.spec: LinearAttention = spec

    def _project(self, x_btd):
        """The convolution's inputs [b, t, channels] (queries, keys, values), z [b, t, v_heads, v_dim], beta's logits
        and the decay input a [b, t, v_heads]."""
        s = self.spec
        b, t, _ = x_btd.shape
        if not s.fused_projections:
            z = self.in_proj_z(x_btd).reshape(b, t, s.num_v_heads, s.v_head_dim)
            return self.in_proj_qkv(x_btd), z, self.in_proj_b(x_btd), self.in_proj_a(x_btd)
        # transformers' `fix_query_key_value_ordering`: each key head's queries, keys, values and z side by side
        per = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x_btd).reshape(b, t, s.num_k_heads, -1)
        q, k, v, z = jnp.split(qkvz, [s.k_head_dim, 2 * s.k_head_dim, 2 * s.k_head_dim + per * s.v_head_dim], -1)
        ba = self.in_proj_ba(x_btd).reshape(b, t, s.num_k_heads, 2 * per)
        beta_logit, a = ba[..., :per].reshape(b, t, -1), ba[..., per:].reshape(b, t, -1)
        mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1)
        return mixed, z.reshape(b, t, s.num_v_heads, s.v_head_dim), beta_logit, a

    def __call__(self, x_btd, positions_bt, cache=None):
        """(output [b, t, d], the updated cache or None)."""
        s = self.spec
        b, t, _ = x_btd.shape
        mixed, z, beta_logit, a = self._project(x_btd)
        counts = _TOKEN_COUNTS.get()
        counts = None if counts is None else micro_batch_slice(counts)
        fresh = positions_bt[:, 0] == 0  # a new sequence in this row: no state from the slot's last occupant
        if cache is None:
            conv_state = jnp.zeros((b, s.conv_kernel - 1, mixed.shape[-1]), mixed.dtype)
            state = None
        else:
            conv_state = jnp.where(fresh[:, None, None], 0, cache[0][:, 0]).astype(mixed.dtype)
            state = jnp.where(fresh[:, None, None, None], 0, cache[1])
        window = jnp.concatenate([conv_state, mixed], axis=1)  # [b, kernel - 1 + t, channels]
        mixed = causal_conv(window, self.conv_weight[...], t)
        q, k, v = jnp.split(mixed, [s.key_dim, 2 * s.key_dim], axis=-1)
        q, k = q.reshape(b, t, s.num_k_heads, -1), k.reshape(b, t, s.num_k_heads, -1)
        v = v.reshape(b, t, s.num_v_heads, -1)

        beta = jax.nn.sigmoid(beta_logit)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        if counts is not None:  # padding: no decay and no write (the state passes through unchanged)
            real_bt = jnp.arange(t)[None, :] < counts[:, None]
            g, beta = jnp.where(real_bt[..., None], g, 0), jnp.where(real_bt[..., None], beta, 0)
        out, state = gated_delta_rule(q, k, v, g, beta, state)
        out = self.norm(out.astype(x_btd.dtype), z)
        out = self.out_proj(out.reshape(b, t, s.value_dim))
        if cache is None:
            return out, None
        return out, (last_inputs(window, counts, t, s.conv_kernel - 1)[:, None].astype(cache[0].dtype), state)


def causal_conv(window_bsc, weight_kc, t: int):
    """silu of the depthwise causal convolution of the last `t` positions of `window` (which starts with the
    kernel - 1 inputs before them), in the inputs' dtype."""
    kernel = weight_kc.shape[0]
    acc = sum(window_bsc[:, j : j + t].astype(jnp.float32) * weight_kc[j].astype(jnp.float32) for j in range(kernel))
    return jax.nn.silu(acc.astype(window_bsc.dtype))


def last_inputs(window_bsc, counts_b, t: int, keep: int):
    """The convolution state as of each row's last real token: its last `keep` inputs, that token's included."""
    if counts_b is None:
        return window_bsc[:, t : t + keep]
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, keep, axis=0))(window_bsc, counts_b)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def gated_delta_rule(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """The gated delta rule over a sequence: q, k [b, t, k_heads, dk], v [b, t, v_heads, dv], g (log decay) and beta
    [b, t, v_heads], state [b, v_heads, dk, dv] (None: zeros). Queries and keys are L2-normalised, queries scaled by
    dk^-1/2. Returns (outputs [b, t, v_heads, dv] float32, the final state float32)."""
    b, t, _, dk = k.shape
    heads, dv = v.shape[2:]
    per = heads // k.shape[2]  # each key head serves `per` consecutive value heads
    q = jnp.repeat(_l2norm(q.astype(jnp.float32)), per, axis=2) * dk**-0.5
    k = jnp.repeat(_l2norm(k.astype(jnp.float32)), per, axis=2)
    v, beta = v.astype(jnp.float32), beta.astype(jnp.float32)
    if state is None:
        state = jnp.zeros((b, heads, dk, dv), jnp.float32)
    if t == 1:
        return _recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    return _chunked(q, k, v, g, beta, state, chunk)


def _recurrent_step(q, k, v, g, beta, state):
    """One token (q, k [b, h, dk], v [b, h, dv], g, beta [b, h]): transformers' torch_recurrent_gated_delta_rule,
    regrouped so that the state (the biggest thing a decode step touches) is read twice and written once: with
    a = exp(g), S' = a S + k (x) d where d = beta (v - a k.S), and q.S' = a q.S + (q.k) d."""
    decay = jnp.exp(g)[..., None]  # [b, h, 1]
    qk_state = jnp.einsum("bhik,bhkv->bhiv", jnp.stack([q, k], axis=2), state, precision=_HIGHEST)
    delta = (v - decay * qk_state[:, :, 1]) * beta[..., None]
    out = decay * qk_state[:, :, 0] + jnp.sum(q * k, axis=-1, keepdims=True) * delta
    state = state * decay[..., None] + k[..., None] * delta[..., None, :]
    return out[:, None], state


def unit_lower_inverse(a):
    """(I + the strictly lower triangle of a)^-1 for a [..., c, c], by forward substitution: row i of the inverse
    is e_i minus a's row i (left of the diagonal) times the rows above it. Plain XLA products in a loop rather than
    XLA:CPU's triangular-solve custom call, whose backward inside this chunked scan hung now and then (jaxlib
    0.10.2, 2 threads: every thread waiting, no CPU used)."""
    c = a.shape[-1]
    columns = jnp.arange(c)

    def row(i, inverse):
        left = jnp.where(columns < i, jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False), 0)
        new = (columns == i) - jnp.einsum("...j,...jk->...k", left, inverse, precision=_HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(inverse, new.astype(inverse.dtype), i, axis=-2)

    return jax.lax.fori_loop(1, c, row, jnp.broadcast_to(jnp.eye(c, dtype=a.dtype), a.shape))


def _chunked(q, k, v, g, beta, state, chunk: int):
    """transformers' torch_chunk_gated_delta_rule: within a chunk the delta-rule writes are one unit
    lower-triangular solve; across chunks a scan carries the state."""
    b, t, heads, dk = k.shape
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [b, t, h, ...] -> [n, b, h, chunk, ...] (zeros past t: no decay, no write)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))  # g, beta: [n, b, h, chunk]
    cum = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], 0)), 0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    def mm(spec, x, y):
        return jnp.einsum(spec, x, y, precision=_HIGHEST)

    system = mm("...ik,...jk->...ij", k_beta, k) * decay  # its strictly lower part: the chunk's writes on each other
    inverse = unit_lower_inverse(system)
    values, k_cumdecay = (
        mm("...ij,...jv->...iv", inverse, v_beta),
        mm("...ij,...jk->...ik", inverse, k_beta * jnp.exp(cum)[..., None]),
    )
    intra = mm("...ik,...jk->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(s, xs):
        values_i, k_cumdecay_i, q_i, k_i, intra_i, decay_i = xs
        new_values = values_i - mm("bhck,bhkv->bhcv", k_cumdecay_i, s)
        out = mm("bhck,bhkv->bhcv", q_i, s) + mm("bhcj,bhjv->bhcv", intra_i, new_values)
        s = s * decay_i + mm("bhck,bhcv->bhkv", k_i, new_values)
        return s, out

    state, out = jax.lax.scan(step, state, (values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, n * chunk, heads, -1)  # [n, b, h, c, dv] -> [b, t, h, dv]
    return out[:, :t], state
