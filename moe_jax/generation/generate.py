"""`Model.generate` and `generate_tokens`: checked prompts in, completions out, through the generation engine.

Prompts of different lengths share a batch right-padded; each row writes its cache at its own positions, so the
padding of a short row is overwritten by its own generated tokens before any query can attend to it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe_jax.errors import InputError
from moe_jax.generation.engine import Completion, Request
from moe_jax.generation.sampling import check_sampling
from moe_jax.model.served_adapters import NO_ADAPTER


def generate(
    model,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    adapter: str | list[str | None] | None = None,
    draft_tokens: int = 0,
) -> list:
    """Generates for a batch of prompts (`Model.generate`): token-id lists give token-id lists, strings give
    strings. Greedy by default; prompt i samples with seed `seed + i`. `adapter`: a served adapter's name
    (`Model.serve_adapters`) for every prompt, or one per prompt (None: the model as loaded). `draft_tokens`:
    speculative decoding with up to that many prompt-lookup drafts a step, as many as pay (greedy: the same
    outputs; sampled: distributed as without; generation/speculation.py)."""
    check_sampling(temperature, top_p, seed=seed)
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
    names = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
    if len(names) != len(prompts):
        raise InputError(f"{len(names)} adapters for {len(prompts)} prompts: give one per prompt, or one name")
    adapters = [model.adapter_index(name) for name in names]
    completions = generate_tokens(
        model, token_prompts, max_new_tokens, temperature, top_p, seed, adapters=adapters, drafts=draft_tokens
    )
    outputs = [c.tokens for c in completions]
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
    slots: int | None = None,
    anchor_cache=None,
    adapters: list[int] | None = None,
    drafts: int = 0,
) -> list[Completion]:
    """Generates for each prompt until EOS, `should_stop(index, tokens)` or `max_new_tokens`, with continuous
    batching over `slots` KV-cache rows (default: up to 16). Prompt i samples with seed `seed + i` and, with
    `adapters`, through served adapter `adapters[i]` (`Model.adapter_index`).

    `timings`, when given, receives prefill/decode seconds and token counts (added to what it holds). `drafts`:
    speculative decoding (GenerationEngine).
    """
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model.config.max_position_embeddings:
        raise InputError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the context window "
            f"({model.config.max_position_embeddings})"
        )
    engine = model.engine(slots or min(len(prompts), 16), longest + max_new_tokens, anchor_cache, drafts)
    adapters = adapters or [NO_ADAPTER] * len(prompts)
    pairs = enumerate(zip(prompts, adapters, strict=True))
    requests = [Request(list(p), max_new_tokens, seed + i, adapter=a) for i, (p, a) in pairs]
    completions = engine.run(
        requests, temperature, top_p, top_k, eos_ids=model.config.eos_token_ids, should_stop=should_stop
    )
    if timings is not None:
        st = engine.stats
        for key, value in (
            ("prefill_s", st.prefill_s),
            ("prefill_tokens", st.prefill_tokens),
            ("decode_s", st.decode_s),
            ("decode_tokens", st.decode_tokens),
        ):
            timings[key] = timings.get(key, 0) + value
    return completions
