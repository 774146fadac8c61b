"""Batched generation over a KV cache: one jit-compiled prefill, then jit-compiled single-token decode steps.

Prompts of different lengths share a batch right-padded; each row writes its cache at its own positions, so the
padding of a short row is overwritten by its own generated tokens before any query can attend to it. Shapes are
rounded up to buckets so a new prompt length rarely means a new compilation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_jax.errors import InputError
from moe_jax.sampling import check_sampling, sample

BUCKET = 32


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str  # "eos", "stop" (a stop condition matched) or "length"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def generate(
    model, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
) -> list:
    check_sampling(temperature, top_p)
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        return []
    as_text = isinstance(prompts[0], str)
    if as_text:
        if model.tokenizer is None:
            raise InputError("string prompts need a tokenizer, and this checkpoint has no tokenizer.json")
        token_prompts = [model.tokenizer.encode(p) for p in prompts]
    else:
        token_prompts = [list(p) for p in prompts]
    for i, p in enumerate(token_prompts):
        if not p:
            raise InputError(f"prompt {i} is empty")
        model.check_token_ids(np.asarray(p))
    outputs = [c.tokens for c in generate_tokens(model, token_prompts, max_new_tokens, temperature, top_p, seed)]
    if as_text:
        return [model.tokenizer.decode(o) for o in outputs]
    return outputs


def generate_tokens(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    top_k: int = 0,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    timings: dict | None = None,
) -> list[Completion]:
    """Generates for each prompt until EOS, `should_stop(row, tokens)` or `max_new_tokens`.

    `timings`, when given, receives prefill/decode seconds and token counts (added to what it holds).
    """
    timings = {} if timings is None else timings
    start = time.perf_counter()
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    longest = int(lengths.max())
    if longest + max_new_tokens > model.config.max_position_embeddings:
        raise InputError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the context window "
            f"({model.config.max_position_embeddings})"
        )
    prefill_len = _round_up(longest, BUCKET)
    caches = model.new_caches(batch, _round_up(prefill_len + max_new_tokens, BUCKET))
    tokens = np.zeros((batch, prefill_len), dtype=np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(prefill_len, dtype=np.int32), tokens.shape)
    logits, caches = model.forward_cached(tokens, positions, caches)
    last_logits = np.asarray(logits)[np.arange(batch), lengths - 1]
    decode_start = time.perf_counter()
    _add(timings, prefill_s=decode_start - start, prefill_tokens=int(lengths.sum()))

    rng = np.random.default_rng(seed)
    eos = set(model.config.eos_token_ids)
    outputs = [Completion([], "length") for _ in range(batch)]
    done = np.zeros(batch, dtype=bool)
    for step in range(max_new_tokens):
        next_tokens = sample(last_logits, rng, temperature, top_p, top_k)
        for i in np.flatnonzero(~done):
            outputs[i].tokens.append(int(next_tokens[i]))
            if int(next_tokens[i]) in eos:
                done[i], outputs[i].finish_reason = True, "eos"
            elif should_stop is not None and should_stop(i, outputs[i].tokens):
                done[i], outputs[i].finish_reason = True, "stop"
        if done.all() or step == max_new_tokens - 1:
            break
        positions = (lengths + step)[:, None].astype(np.int32)
        logits, caches = model.forward_cached(next_tokens[:, None].astype(np.int32), positions, caches)
        last_logits = np.asarray(logits)[:, 0]
    _add(timings, decode_s=time.perf_counter() - decode_start, decode_tokens=sum(len(c.tokens) for c in outputs))
    return outputs


def _add(totals: dict, **amounts):
    for key, value in amounts.items():
        totals[key] = totals.get(key, 0) + value
