"""Next-token choice from logits on the host: greedy, temperature, top-p (nucleus), top-k."""

from __future__ import annotations

import numpy as np

from moe_jax.errors import InputError


def check_sampling(temperature: float, top_p: float, top_k: int = 0, seed: int = 0):
    if not np.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InputError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if seed < 0:
        raise InputError(f"seed must be >= 0, got {seed}")


def sample(
    logits_bv: np.ndarray, rng: np.random.Generator, temperature: float, top_p: float, top_k: int = 0
) -> np.ndarray:
    if temperature == 0:
        return np.argmax(logits_bv, axis=-1)
    z = logits_bv.astype(np.float64)
    # shifted before dividing: a tiny temperature sends the others to -inf, never the best to inf (inf - inf = NaN)
    z = (z - z.max(axis=-1, keepdims=True)) / temperature
    if top_k and top_k < z.shape[-1]:  # a top-k at or above the vocabulary keeps every token
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-probs, axis=-1)
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p >= top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=p) for p in probs])
