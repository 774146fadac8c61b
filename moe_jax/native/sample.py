"""A sampled decode step's tokens chosen where its logits are: each row at its own temperature, top-p and top-k, with
a uniform draw the host made from the request's generator (host_kernels/csrc/xla_sample.c on XLA:CPU, AVX-512 or
AVX2; jax.numpy elsewhere). With them a block of sampled steps runs on the device as a greedy block does, and the
tokens are the host sampler's (moe_jax/generation/sampling.py) for the same draws.

How it works and why: docs/INTERNALS.md, moe_jax/native/sample.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.native import ffi
from moe_jax.native.argmax import CPU_FLAGS, argmax_tokens

TARGET = "moe_jax_sample"
DRAW_BELOW_ONE = 1.0 - 2.0**-24  # jax.numpy's float32 draws are rounded to below 1: a draw of 1 has no token


class TokenChoice(NamedTuple):
    """How a step chooses each row's token: `temperature` (0: its argmax), `top_p`, `top_k` (0: off) [rows], and its
    draw in [0, 1) as float64 bits [rows, 2] uint32 (host_draws; a block's: [steps, rows, 2])."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    draws: jax.Array


def status(isa: str | None = None) -> tuple[bool, str]:
    """(usable, why not) for the native sampler: on `isa`, or on any of its variants (the native argmax's)."""
    return ffi.variants_status(CPU_FLAGS, isa)


def host_draws(draws: np.ndarray) -> np.ndarray:
    """float64 draws [...] (numpy Generator.random's) as the uint32 pairs [..., 2] a TokenChoice carries them in:
    XLA without x64 has no float64 arrays, and a float32 draw would give a token of probability under 2^-24 none."""
    return np.ascontiguousarray(draws, np.float64).view(np.uint32).reshape(*np.shape(draws), 2)


def sample_tokens(logits_bv, choice: TokenChoice, native: bool, isa: str | None = None):
    """Each row's token, int32 [b, 1]: with `native` (the plan's choice, as the argmax's) the native handler for
    float32 logits (on `isa`, by default the fastest this CPU runs), else jax.numpy's (in float32)."""
    if logits_bv.dtype != jnp.float32 or not native:
        return _sample_jnp(logits_bv.astype(jnp.float32), choice)
    isa = ffi.fastest(CPU_FLAGS, isa)
    ffi.require(status(isa), f"sampling ({isa})")
    result = jax.ShapeDtypeStruct((logits_bv.shape[0], 1), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")
    return call(
        logits_bv,
        choice.temperature.astype(jnp.float32),
        choice.top_p.astype(jnp.float32),
        choice.top_k.astype(jnp.int32),
        choice.draws.astype(jnp.uint32),
        avx512=np.int64(isa == "avx512"),
    )


def _draws_f32(bits):
    """The float64 draws [rows] whose bits [rows, 2] uint32 (low word first) carry them, rounded to float32."""
    low, high = bits[:, 0], bits[:, 1]
    exponent = ((high >> 20) & 0x7FF).astype(jnp.int32)
    mantissa = (high & 0xFFFFF).astype(jnp.float32) * 2.0**-20 + low.astype(jnp.float32) * 2.0**-52
    u = jnp.where(exponent == 0, 0.0, jnp.ldexp(1.0 + mantissa, exponent - 1023))
    return jnp.minimum(u, DRAW_BELOW_ONE)


def _sample_jnp(logits, choice: TokenChoice):
    """The native handler's choice in jax.numpy, float32 throughout (the sort only where a row cuts its tail): for
    an accelerator's steps. A NaN row gives token 0 here (the native handler and the host refuse it)."""
    vocab = logits.shape[-1]
    t, top_p, top_k = choice.temperature, choice.top_p, choice.top_k
    sampled = t > 0
    z = (logits - logits.max(-1, keepdims=True)) / jnp.where(sampled, t, 1.0)[:, None]
    p = jnp.exp(z)
    cuts = sampled & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))

    def cut(p):
        order = jnp.argsort(-p, axis=-1, stable=True)  # falling probability, ties in token order
        ranked = jnp.take_along_axis(p, order, axis=-1)
        k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)  # top-k keeps the ties with the k-th
        ranked = jnp.where(ranked >= kth, ranked, 0.0)
        before = jnp.cumsum(ranked, axis=-1) - ranked
        keep = (ranked > 0) & ((before < top_p[:, None] * ranked.sum(-1, keepdims=True)) | (top_p[:, None] >= 1))
        keep = keep.at[:, 0].set(True)  # the most likely token always stays
        kept = jnp.zeros_like(keep).at[jnp.arange(p.shape[0])[:, None], order].set(keep)
        return jnp.where(kept, p, 0.0)

    p = jax.lax.cond(cuts.any(), cut, lambda p: p, p)
    cdf = jnp.cumsum(p, axis=-1)
    target = _draws_f32(choice.draws) * cdf[:, -1]
    last_live = vocab - 1 - jnp.argmax((p > 0)[:, ::-1], axis=-1)
    token = jnp.minimum(jnp.sum(cdf <= target[:, None], axis=-1), last_live).astype(jnp.int32)
    return jnp.where(sampled, token, argmax_tokens(logits, False)[:, 0])[:, None]
