"""Next-token choice from logits on the host: greedy, temperature, top-p (nucleus), top-k.

How it works and why: docs/INTERNALS.md, moe_jax/generation/sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_jax.errors import InputError, MoeJaxError

# probabilities above which the nucleus is looked for first (at most 1/floor tokens to sort); the next floor when
# the cut is not among them
NUCLEUS_FLOORS = (1e-3, 1e-5, 0.0)


def check_sampling(temperature: float, top_p: float, top_k: int = 0, seed: int = 0):
    if not np.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InputError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if seed < 0:
        raise InputError(f"seed must be >= 0, got {seed}")


def adjusted_logits(logits: np.ndarray, sampling, generated: list[int]) -> np.ndarray:
    """`logits` [vocab] with `sampling`'s logit bias added and its penalties taken off, as OpenAI's API defines
    them: each token generated so far loses `presence_penalty` once and `frequency_penalty` per occurrence."""
    z = np.array(logits, np.float32)
    if sampling.logit_bias:
        tokens, bias = zip(*sampling.logit_bias, strict=True)
        z[list(tokens)] += np.asarray(bias, np.float32)
    if generated and (sampling.presence_penalty or sampling.frequency_penalty):
        tokens, counts = np.unique(np.asarray(generated), return_counts=True)
        z[tokens] -= counts * sampling.frequency_penalty + sampling.presence_penalty
    return z


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability under the model (the log-softmax of its raw logits: before any bias,
    penalty or temperature, as OpenAI reports them) and the `top` most likely tokens' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    z = np.asarray(logits, np.float64)
    peak = z.max()
    log_total = peak + np.log(np.exp(z - peak).sum())
    best = np.argpartition(-z, top - 1)[:top] if 0 < top < z.size else np.arange(z.size if top else 0)
    best = best[np.lexsort((best, -z[best]))]  # most likely first, ties by token id
    return TokenLogprobs(token, float(z[token] - log_total), tuple((int(t), float(z[t] - log_total)) for t in best))


def sample(
    logits_bv: np.ndarray, rng: np.random.Generator, temperature: float, top_p: float, top_k: int = 0
) -> np.ndarray:
    """One token per row of `logits_bv` [b, vocab]: argmax at temperature 0, else a draw from `rng`."""
    if temperature == 0:
        return np.argmax(logits_bv, axis=-1)
    return np.array([_draw(row, rng, temperature, top_p, top_k) for row in logits_bv])


def _draw(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_p: float, top_k: int) -> int:
    tokens, probs = distribution(logits, temperature, top_p, top_k)
    return _from(tokens, probs, rng)


def _from(tokens: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)  # in token order, as choice's over the whole vocabulary (its zeros add nothing)
    cdf /= cdf[-1]
    return int(tokens[np.searchsorted(cdf, rng.random(), side="right")])


def distribution(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a draw at `temperature` (> 0) with top-p and top-k can give, in token order, and their
    probabilities."""
    z = logits.astype(np.float64)
    # shifted before dividing: a tiny temperature sends the others to -inf, never the best to inf (inf - inf = NaN)
    with np.errstate(invalid="ignore"):  # (an inf logit: inf - inf, refused below by name)
        z = (z - z.max()) / temperature
    if top_k and top_k < z.size:  # a top-k at or above the vocabulary keeps every token
        kth = np.partition(z, z.size - top_k)[z.size - top_k]
        tokens = np.flatnonzero(z >= kth)  # ties with the k-th are kept
    else:
        tokens = np.arange(z.size)
    probs = np.exp(z[tokens])
    total = probs.sum()
    if not np.isfinite(total):  # (a NaN logit, or +inf: inf - inf is NaN)
        raise MoeJaxError(f"a row of logits to sample from holds NaN or inf (max {logits.max()}): the model is broken")
    probs /= total
    if top_p < 1:
        tokens, probs = _nucleus(tokens, probs, top_p)
    return tokens, probs


def sample_past_draft(
    logits: np.ndarray, draft: int, rng: np.random.Generator, temperature: float, top_p: float, top_k: int = 0
) -> int:
    """A token drawn as `_draw` would, given a draft token guessed without a model (prompt lookup: all its
    probability on one token): the draft, kept with its probability p under the model, or else a draw from the
    model's distribution without it. Either way the token is distributed as a plain draw is (speculative sampling,
    Leviathan et al. 2023 and Chen et al. 2023, whose residual max(p - q, 0) is p without the draft here)."""
    tokens, probs = distribution(logits, temperature, top_p, top_k)
    at = np.searchsorted(tokens, draft)
    p = probs[at] if at < len(tokens) and tokens[at] == draft else 0.0
    if rng.random() < p:
        return int(draft)
    if p:
        probs = probs.copy()
        probs[at] = 0.0
    return _from(tokens, probs, rng)


def _nucleus(tokens: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens (in token order) of the smallest prefix by falling probability whose mass reaches top_p (the
    most likely token always kept; tied tokens in token order), and their probabilities renormalized."""
    for floor in NUCLEUS_FLOORS:
        likely = np.flatnonzero(probs >= floor)  # the most likely tokens, ties included: a prefix of the ranking
        candidates = probs[likely]
        if floor and candidates.sum() < top_p:  # all of them kept: the cut lies below (no sort for that)
            continue
        ranked = -np.sort(-candidates)
        kept = int(np.count_nonzero(np.cumsum(ranked) - ranked < top_p))  # (a prefix: the sums only grow)
        if kept < len(likely) or floor == 0:  # the cut lies inside: the tokens below the floor are dropped too
            break
    last = ranked[kept - 1]
    keep = candidates >= last
    ties = np.flatnonzero(candidates == last)
    keep[ties[kept - (np.count_nonzero(keep) - len(ties)) :]] = False  # ties with the last: the first by token
    keep = likely[keep]
    return tokens[keep], probs[keep] / probs[keep].sum()
