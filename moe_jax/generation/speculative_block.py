"""Speculative decoding inside one device call: up to a block of steps, each drafting every row's next tokens from its
own sequence (prompt lookup), verifying them in one pass and keeping those greedy decoding would have made.

How it works and why: docs/INTERNALS.md, moe_jax/generation/speculative_block.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.generation.drafting import prompt_lookup, stops_drafting
from moe_jax.native.argmax import argmax_tokens


class SpeculativeOutput(NamedTuple):
    tokens: jax.Array  # [rows, block * width]: each row's new tokens, the first `made` of them real
    made: jax.Array  # [rows]
    drafted: jax.Array  # [rows]: drafts verified
    accepted: jax.Array  # [rows]: ... and accepted
    accepted_counts: jax.Array  # [width]: the sequences' steps by how many drafts they accepted (0 to width - 1)
    ran: jax.Array  # steps run
    caches: list


def speculative_block(
    forward,
    native_argmax: bool,
    leaves,
    caches,
    history,
    first,
    lengths,
    budget,
    kept_before,
    gate,
    adapters,
    steps,
    stop_ids,
    watched,
    rows=None,
    *,
    block: int,
    width: int,
) -> SpeculativeOutput:
    """Up to `steps` (traced; at most `block`) steps of `width` tokens a row: its last token and up to width - 1
    drafts, through `forward` (the compiled steps' forward: leaves, caches, tokens, positions, adapters, rows,
    several) for the first `rows` slots (None: all). `history` [rows, capacity]: what each row's lookup searches,
    its first `lengths` tokens: from index `first` on its sequence so far (the last token not yet through the
    model), before it the earlier outputs it may draft from; `budget` [rows]: the most tokens a row may make (0: a
    free row, whose tokens nobody reads); `kept_before` [2, rows]: each row's drafts verified and kept before this
    call, and `gate` (drafts, share): `drafting.stops_drafting`'s bounds, counted within the call too. The loop
    ends early after a step where a `watched` row made one of `stop_ids` (-1 pads) or a row spent its budget.
    `native_argmax`: the plan's choice for greedy tokens."""

    def chosen_after(caches, tokens, positions, several):
        logits, caches = forward(leaves, caches, tokens, positions, adapters, rows, several=several)
        b, t, vocab = logits.shape
        return argmax_tokens(logits.reshape(b * t, vocab), native_argmax).reshape(b, t), caches

    count, capacity = history.shape
    places = jnp.arange(width)[None, :]
    row_ids = jnp.arange(count)[:, None]
    zeros = jnp.zeros(count, jnp.int32)
    steps = jnp.minimum(steps, block)

    def go_on(carry):
        i, stopped = carry[0], carry[-1]
        return (i < steps) & ~stopped

    def step(carry):
        i, history, lengths, made, out, drafted, accepted, counts, caches, _ = carry
        drafts, real = prompt_lookup(history, lengths, width - 1)
        real = jnp.minimum(real, jnp.maximum(budget - made - 1, 0))  # never past a row's budget
        verified_so_far, kept_so_far = kept_before[0] + drafted, kept_before[1] + accepted
        real = jnp.where(stops_drafting(verified_so_far, kept_so_far, *gate), 0, real)
        last = jnp.take_along_axis(history, (lengths - 1)[:, None], axis=1)
        tokens = jnp.concatenate([last, drafts], axis=1)
        positions = (lengths - 1 - first)[:, None] + places

        def verify(caches):
            return chosen_after(caches, tokens, positions, True)

        def plain(caches):  # no row has drafts: one token a row, as a plain decode step
            chosen, caches = chosen_after(caches, last, positions[:, :1], False)
            return jnp.pad(chosen, ((0, 0), (0, width - 1)), constant_values=-1), caches

        chosen, caches = jax.lax.cond((real > 0).any(), verify, plain, caches)
        agree = (drafts == chosen[:, :-1]) & (places[:, :-1] < real[:, None])
        taken = jnp.cumprod(agree, axis=1).sum(axis=1).astype(jnp.int32)
        new = taken + 1  # the accepted drafts and the model's own token after them
        kept = places < new[:, None]
        history = history.at[row_ids, jnp.where(kept, lengths[:, None] + places, capacity)].set(chosen, mode="drop")
        out = out.at[row_ids, jnp.where(kept, made[:, None] + places, block * width)].set(chosen, mode="drop")
        made = made + new
        ended = watched & (kept & (chosen[:, :, None] == stop_ids[None, None, :]).any(axis=2)).any(axis=1)
        stopped = ended.any() | ((made >= budget) & (budget > 0)).any()
        return (
            i + 1,
            history,
            lengths + new,
            made,
            out,
            drafted + real,
            accepted + taken,
            counts + ((places == taken[:, None]) & (budget > 0)[:, None]).sum(axis=0, dtype=jnp.int32),
            caches,
            stopped,
        )

    out = jnp.zeros((count, block * width), jnp.int32)
    start = (jnp.int32(0), history, lengths, zeros, out, zeros, zeros, jnp.zeros(width, jnp.int32), caches, False)
    ran, _, _, made, out, drafted, accepted, counts, caches, _ = jax.lax.while_loop(go_on, step, start)
    return SpeculativeOutput(out, made, drafted, accepted, counts, ran, caches)
