"""A request's n choices: n generations of one prompt, each sampled with its own seed, collected or streamed
together.

Choice i samples with the prompt's seed + i, so it equals a request of one choice with that seed (greedy choices
are all the same answer, as OpenAI's are). They are submitted as n jobs of the continuous batch, each prefilled
as its own row (admitted together, in one batched prefill step): the prompt's prefill is not shared between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from moe_jax.serving.generation import Generation, Prompt
from moe_jax.serving.openai_api import Choice


def submit_choices(service, prompt: Prompt, n: int, dialect=None) -> list[Generation]:
    """n generations of `prompt` (seeds prompt.seed, +1, ...); all or none: a full queue (QueueFull) part way
    cancels those already submitted."""
    generations = []
    try:
        for i in range(n):
            generations.append(service.submit(dataclasses.replace(prompt, seed=prompt.seed + i), dialect))
    except BaseException:
        for g in generations:
            g.cancel()
        raise
    return generations


async def whole_choices(
    generations: list[Generation],
    disconnected: Callable[[], Awaitable[bool]],
    logprobs: Callable[[list], dict] | None,
) -> list[Choice]:
    """Every choice's whole output, generated side by side; `logprobs` formats a choice's log-probabilities
    (None: not asked for). A client that goes away, or a choice that fails, cancels them all."""

    async def one(generation: Generation) -> Choice:
        pieces = [p async for p in generation.pieces(disconnected)]
        formatted = logprobs(generation.logprobs) if logprobs is not None else None
        return Choice(pieces, generation.completion, formatted)

    try:
        return list(await asyncio.gather(*(one(g) for g in generations)))
    finally:
        for g in generations:
            if g.completion is None:
                g.cancel()


async def merged(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The events of several streams as each produces them (one stream: passed through as it is)."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[bytes]):
        try:
            async for event in stream:
                await queue.put(event)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        finished = 0
        while finished < len(tasks):
            event = await queue.get()
            if event is done:
                finished += 1
            else:
                yield event
    finally:
        for task in tasks:
            task.cancel()
