"""The generation engine's side of the anchor cache: what a slot's cache rows give a new segment, what a cached
prefix writes into a slot, and where a prefill must pause so that recurrent layers' states at anchors exist to be
saved (generation/prefill_pieces.py)."""

from __future__ import annotations

import numpy as np

from moe_jax.generation.anchor_cache import AnchorCache, RecurrentState


def state_stops(cache: AnchorCache | None, config, tokens, reused: int, scope: bytes) -> list[int]:
    """Where (within the suffix after `reused` tokens) a prefill step must end so that the recurrent layers' state
    at an anchor can be saved: the anchors not cached yet, for a model with recurrent layers (none otherwise: a KV
    segment is cut from the cache after the prefill, at any position)."""
    if cache is None or not config.linear_layers:
        return []
    return [end - reused for end in cache.anchors(tokens) if end > reused and not cache.cached(tokens[:end], scope)]


def recurrent_rows(caches, slot: int, layers) -> dict[int, RecurrentState]:
    """The recurrent `layers`' cache rows of `slot`, by layer (a device-to-host copy)."""
    return {
        layer: RecurrentState(np.asarray(caches[layer][0][slot]), np.asarray(caches[layer][1][slot]))
        for layer in layers
    }


def store_anchors(cache: AnchorCache, caches, slot: int, tokens, scope: bytes, states: dict, recurrent=()):
    """Stores the anchor segments of the prompt in `slot`: attention layers' KV cut from the slot's rows, the
    `recurrent` layers' rows as `states` saved them at each anchor (prompt length -> recurrent_rows) during the
    prefill."""
    rows = None
    recurrent = set(recurrent)

    def kv_of_range(start, end):
        nonlocal rows
        if recurrent and end not in states:  # not passed by this prefill (its segment was evicted meanwhile)
            return None
        if rows is None:  # one device-to-host copy of the slot's rows, only when a segment is new
            rows = [
                None if i in recurrent else tuple(np.asarray(a[slot]) for a in layer) for i, layer in enumerate(caches)
            ]
        # the anchor cache holds token-major segments [n, kv, hd]; the engine's cache is [kv, s, hd] a row
        return [
            states[end][i] if i in recurrent else tuple(a[:, start:end].swapaxes(0, 1) for a in layer)
            for i, layer in enumerate(rows)
        ]

    cache.store(tokens, kv_of_range, scope)


def slot_rows(prefix: list, length: int) -> list:
    """A cached prefix (per layer token-major (k, v) [n, kv, hd], or a RecurrentState) as the rows `write_prefix`
    puts at the start of a slot: keys and values [kv, length, hd] (zeros past n: `length` is n rounded up to a
    token bucket, a compiled shape per bucket), a recurrent layer's rows as they are."""
    rows = []
    for entry in prefix:
        if isinstance(entry, RecurrentState):
            rows.append(tuple(entry))
        else:
            rows.append(tuple(_pad(a, length).swapaxes(0, 1) for a in entry))
    return rows


def _pad(array: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros((length, *array.shape[1:]), array.dtype)
    out[: len(array)] = array
    return out
