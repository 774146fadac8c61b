"""Prompt-lookup drafting on the device: each row's next tokens guessed from its own sequence and from what earlier
sequences of its scope wrote (`SharedDrafts`), without a draft model.

Agent and editing workloads copy from their context (file paths, code, the lines an edit keeps) and repeat their
own earlier outputs (a tool call's syntax), so the n-gram that ends a sequence has often occurred before, and what
followed it then is a good guess of what follows now.

How it works and why: docs/INTERNALS.md, moe_jax/generation/drafting.py.
"""

from __future__ import annotations

from collections import OrderedDict

import jax.numpy as jnp
import numpy as np

MAX_NGRAM = 3  # the longest n-gram matched; shorter ones are tried when it has not occurred before
SHARED_TOKENS = 1024  # the most tokens of earlier outputs a scope keeps for drafting
SHARED_SCOPES = 64  # scopes kept (the least recently used one is dropped)
NOTHING = -1  # no token: pads a history, separates outputs (matches no token and ends a draft)


class SharedDrafts:
    """Each scope's latest outputs, oldest first, each closed by NOTHING: what a new sequence's lookup searches
    before its own tokens. A scope is a request's anchor-cache scope (its client's and adapter's), so one client's
    drafts never come from another's text (whose acceptance would show in its timing)."""

    def __init__(self, tokens: int = SHARED_TOKENS, scopes: int = SHARED_SCOPES):
        self.size, self.scopes = tokens, scopes
        self.kept: OrderedDict[bytes, tuple[np.ndarray, int]] = OrderedDict()  # scope -> (ring, where it ends)

    def tokens(self, scope: bytes) -> np.ndarray:
        """The scope's kept outputs, `size` tokens (NOTHING before the first)."""
        if scope not in self.kept:
            return np.full(self.size, NOTHING, np.int32)
        self.kept.move_to_end(scope)
        ring, end = self.kept[scope]
        return np.concatenate([ring[end:], ring[:end]])

    def add(self, scope: bytes, output: list[int]):
        """Keeps a finished sequence's output (its last `size` - 1 tokens at most)."""
        ring, end = self.kept.pop(scope, None) or (np.full(self.size, NOTHING, np.int32), 0)
        for token in [*output[-(self.size - 1) :], NOTHING]:  # (a few tokens: a loop costs less than arrays)
            ring[end] = token
            end = (end + 1) % self.size
        self.kept[scope] = (ring, end)
        if len(self.kept) > self.scopes:
            self.kept.popitem(last=False)


def stops_drafting(verified, kept, drafts: int, share: float):
    """Whether a sequence drafts no more: it has had `drafts` drafts verified and kept fewer than `share` of them
    (it does not copy: its drafts would only cost verify steps). Python numbers or arrays alike."""
    return (verified >= drafts) & (kept < share * verified)


def shifted_right(history, by: int):
    """history[:, e - by] at each e (NOTHING where e < by)."""
    return jnp.pad(history, ((0, 0), (by, 0)), constant_values=NOTHING)[:, : history.shape[1]]


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
    real = jnp.cumprod((drafts != NOTHING) & (starts < last), axis=1).sum(axis=1)
    return drafts, jnp.where(found >= 0, real, 0).astype(jnp.int32)
