"""The semantic anchor cache: KV state at anchor boundaries, kept in host memory, reused by later requests.

How it works and why: docs/INTERNALS.md, moe_jax/generation/anchor_cache.py.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moe_jax.errors import InputError


def anchor_token_ids(tokenizer, names=()) -> list[int]:
    """Anchor tokens: those named, else the special tokens the chat template writes (message, tool and thinking
    delimiters: where a conversation's edits begin and end)."""
    if tokenizer is None:
        return []
    ids = []
    for name in names or tokenizer.template_special_tokens():
        token = tokenizer.token_to_id(name)
        if token is None:
            raise InputError(f"anchor token {name!r} is not a token of this tokenizer")
        ids.append(token)
    return ids


def prefix_key(tokens, scope: bytes = b"") -> bytes:
    """An entry's key: its prefix's tokens within a scope (a server's tenant: entries of one scope are not found
    from another, so neither their contents nor their existence reach another tenant). A keyed hash: a scope of
    up to 64 bytes."""
    return hashlib.blake2b(np.asarray(tokens, np.int64).tobytes(), digest_size=16, key=scope).digest()


class RecurrentState(NamedTuple):
    """A recurrent layer's cache row as of an anchor: its convolution inputs and its state (model/delta_net.py)."""

    conv: np.ndarray
    state: np.ndarray


def copied(entry):
    """A layer's segment entry, (k, v) or RecurrentState, as owned numpy arrays."""
    arrays = [np.array(a) for a in entry]
    return RecurrentState(*arrays) if isinstance(entry, RecurrentState) else tuple(arrays)


@dataclass
class Segment:
    key: bytes
    parent: bytes | None
    start: int
    end: int
    # per layer: its cached arrays over these positions (k [end - start, kv_heads, head_dim] and v; MLA's latent,
    # rotary key and indexer key), numpy, or a RecurrentState as of `end`
    kv: list
    children: set = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for entry in self.kv for a in entry)


@dataclass
class AnchorStats:
    requests: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    hits: int = 0
    evictions: int = 0

    def as_dict(self, bytes_held: int) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "reused_tokens": self.prompt_tokens - self.prefilled_tokens,
            "hits": self.hits,
            "evictions": self.evictions,
            "bytes_held": bytes_held,
        }


class AnchorCache:
    def __init__(self, anchor_token_ids, budget_bytes: int = 1 << 30):
        self.anchor_ids = frozenset(int(t) for t in anchor_token_ids)
        self.budget = int(budget_bytes)
        self.segments: OrderedDict[bytes, Segment] = OrderedDict()  # LRU order: oldest first
        self.bytes_held = 0
        self.stats = AnchorStats()

    def anchors(self, tokens) -> list[int]:
        """Prefix lengths that end right after an anchor token (the last token is never one: it must be
        prefilled to give the next-token logits)."""
        return [i + 1 for i, t in enumerate(tokens[:-1]) if t in self.anchor_ids]

    def lookup(self, tokens, scope: bytes = b"") -> tuple[int, list]:
        """(reused length, per layer (k, v) of that prefix or its RecurrentState) for the longest anchor prefix cached
        in `scope`."""
        self.stats.requests += 1
        self.stats.prompt_tokens += len(tokens)
        for length in reversed(self.anchors(tokens)):
            chain = self._chain(prefix_key(tokens[:length], scope))
            if chain is not None:
                for seg in chain:
                    self.segments.move_to_end(seg.key)
                kv = [
                    chain[-1].kv[i]
                    if isinstance(chain[-1].kv[i], RecurrentState)
                    else tuple(np.concatenate([s.kv[i][j] for s in chain]) for j in range(len(chain[0].kv[i])))
                    for i in range(len(chain[0].kv))
                ]
                self.stats.hits += 1
                self.stats.prefilled_tokens += len(tokens) - length
                return length, kv
        self.stats.prefilled_tokens += len(tokens)
        return 0, []

    def _chain(self, key: bytes) -> list[Segment] | None:
        chain = []
        while key is not None:
            seg = self.segments.get(key)
            if seg is None:
                return None
            chain.append(seg)
            key = seg.parent
        return chain[::-1]

    def cached(self, prefix, scope: bytes = b"") -> bool:
        return prefix_key(prefix, scope) in self.segments

    def store(self, tokens, kv_of_range, scope: bytes = b""):
        """Caches every anchor prefix of `tokens` not cached yet in `scope`. `kv_of_range(start, end)` returns the
        per-layer (k, v) of those positions, or a recurrent layer's RecurrentState as of `end` (called only for
        segments that are new; None where it cannot: nothing from there on is stored)."""
        parent = None
        start = 0
        for end in self.anchors(tokens):
            key = prefix_key(tokens[:end], scope)
            if key not in self.segments:
                entries = kv_of_range(start, end)
                if entries is None:
                    return
                seg = Segment(key, parent, start, end, [copied(entry) for entry in entries])
                if seg.nbytes > self.budget:
                    return
                self.segments[key] = seg
                self.bytes_held += seg.nbytes
                if parent is not None:
                    self.segments[parent].children.add(key)
                self._evict(keep=key)
                if key not in self.segments:  # evicted at once: nothing later can chain to it
                    return
            else:
                self.segments.move_to_end(key)
            parent, start = key, end

    def _evict(self, keep: bytes):
        while self.bytes_held > self.budget:
            victim = next((k for k in self.segments if k != keep and not self._is_ancestor(k, keep)), None)
            if victim is None:
                victim = keep
            self._drop(victim)

    def _is_ancestor(self, candidate: bytes, key: bytes) -> bool:
        seg = self.segments.get(key)
        while seg is not None and seg.parent is not None:
            if seg.parent == candidate:
                return True
            seg = self.segments.get(seg.parent)
        return False

    def _drop(self, key: bytes):
        seg = self.segments.pop(key, None)
        if seg is None:
            return
        self.bytes_held -= seg.nbytes
        self.stats.evictions += 1
        if seg.parent in self.segments:
            self.segments[seg.parent].children.discard(key)
        for child in list(seg.children):
            self._drop(child)

    def summary(self) -> dict:
        return self.stats.as_dict(self.bytes_held)
