"""Prompt-lookup drafting on the device: each row's next tokens guessed from its own sequence, without a draft model.

Agent and editing workloads copy from their context (file paths, code, the lines an edit keeps), so the n-gram that
ends a sequence has often occurred before, and what followed it then is a good guess of what follows now.

How it works and why: docs/INTERNALS.md, moe_jax/generation/drafting.py.
"""

from __future__ import annotations

import jax.numpy as jnp

MAX_NGRAM = 3  # the longest n-gram matched; shorter ones are tried when it has not occurred before


def shifted_right(history, by: int):
    """history[:, e - by] at each e (-1 where e < by)."""
    return jnp.pad(history, ((0, 0), (by, 0)), constant_values=-1)[:, : history.shape[1]]


def prompt_lookup(history, lengths, count: int, max_ngram: int = MAX_NGRAM):
    """Up to `count` drafts for each row of `history` [rows, capacity] (its first `lengths` [rows] tokens are the
    sequence): the tokens that followed the latest earlier occurrence of its longest suffix of at most `max_ngram`
    tokens. Returns (drafts [rows, count], how many of them are real [rows]: 0 where no suffix occurred before)."""
    capacity = history.shape[1]
    ends = jnp.arange(capacity)[None, :]  # e: the index just past an occurrence, where its continuation starts
    last = lengths[:, None]
    found = jnp.full(lengths.shape, -1, jnp.int32)  # the continuation's start (-1: none yet)
    for n in range(1, max_ngram + 1):  # a longer match replaces a shorter one
        # an occurrence must end before the sequence's own suffix does (so it has a successor) and start at 0 or later
        match = (ends >= n) & (ends < last) & (last >= n)
        for i in range(n):  # the occurrence's i-th token against the suffix's
            suffix_token = jnp.take_along_axis(history, jnp.maximum(last - n + i, 0), axis=1)
            match &= shifted_right(history, n - i) == suffix_token
        latest = jnp.max(jnp.where(match, ends, -1), axis=1)
        found = jnp.where(latest >= 0, latest, found)
    starts = jnp.maximum(found, 0)[:, None] + jnp.arange(count)[None, :]
    drafts = jnp.take_along_axis(history, jnp.minimum(starts, capacity - 1), axis=1)
    real = jnp.where(found >= 0, jnp.clip(lengths - found, 0, count), 0)
    return drafts, real.astype(jnp.int32)
