"""One request's generation, from the engine thread to its connection's event loop.

The engine thread calls the job's callbacks; they turn tokens into text (stop strings applied) and post it to an
asyncio queue with `call_soon_threadsafe`, the only safe way into the loop from another thread. The connection
reads parsed pieces (reasoning, answer, tool calls) from `pieces()` as they come, and cancels the job when its
client goes away.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from moe_jax.generation.batch import GRAMMAR_DEAD_END, Completion, Request, Sampling
from moe_jax.generation.constraint import DEAD_END_MESSAGE, Constraint, GrammarDeadEnd
from moe_jax.generation.sampling import TokenLogprobs
from moe_jax.serving.output_parser import Dialect, OutputParser, Parsed
from moe_jax.serving.scheduler import ServedJob
from moe_jax.serving.text_stream import TextStream

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


@dataclass
class Prompt:
    """What a request asks for, checked: token ids, the rendered text (None for token ids), how to sample."""

    tokens: list[int]
    text: str | None
    max_tokens: int
    sampling: Sampling
    seed: int
    stops: list[str]
    eos_ids: frozenset[int]
    cache_scope: bytes = b""
    constraint: Constraint | None = None  # the grammar the output keeps to, at its start (each generation copies it)
    adapter: int = 0  # the served adapter it runs through (Model.adapter_index; 0: none)


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class Mailbox:
    """The engine thread's way into one event loop: what it posts for any generation waits here, and one wake-up
    of the loop delivers everything posted meanwhile (a decode step's tokens for every connection), rather than
    a wake-up per token and connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[Generation, tuple]] = []
        self._wake_pending = False
        self._lock = threading.Lock()

    def post(self, generation: Generation, item: tuple):
        """Engine thread. False when the loop has closed (the server is gone, and so is whoever asked)."""
        with self._lock:
            self._items.append((generation, item))
            if self._wake_pending:
                return True
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            return False
        return True

    def _deliver(self):
        with self._lock:
            items, self._items, self._wake_pending = self._items, [], False
        by_generation: dict[Generation, list] = {}
        for generation, item in items:
            by_generation.setdefault(generation, []).append(item)
        for generation, its_items in by_generation.items():
            generation.queue.put_nowait(its_items)


class Generation:
    def __init__(
        self,
        prompt: Prompt,
        decode: Callable[[list[int]], str],
        dialect: Dialect,
        mailbox: Mailbox,
        on_done: Callable[[Completion], None] | None = None,
    ):
        """`on_done(completion)`: on the engine thread when the job ends, however (an error is a completion
        with finish_reason "error")."""
        self.prompt, self.mailbox, self.on_done = prompt, mailbox, on_done
        self.queue: asyncio.Queue = asyncio.Queue()  # lists of items, in order
        self.stream = TextStream(decode, prompt.stops)
        self.parser = OutputParser.for_prompt(dialect, prompt.text or "")
        self.completion: Completion | None = None
        self.logprobs: list[TokenLogprobs] = []  # every output token's, as they reach the loop (logprobs asked)
        self._logprobs_taken = 0
        self._unposted_logprobs: list[TokenLogprobs] = []  # engine thread: of tokens whose text is held back
        request = Request(prompt.tokens, prompt.max_tokens, prompt.seed, prompt.cache_scope, prompt.adapter)
        self.job = ServedJob(
            request,
            prompt.sampling,
            self._on_token,
            self._on_finish,
            prompt.eos_ids,
            on_logprobs=self._unposted_logprobs.append if prompt.sampling.logprobs is not None else None,
            constraint=prompt.constraint.copy() if prompt.constraint is not None else None,
            on_error=self._on_error,
        )

    # ---------------------------------------------------------------- engine thread
    def _post(self, item):
        if not self.mailbox.post(self, item):
            self.job.cancelled = True

    def _take_unposted(self) -> list[TokenLogprobs]:
        taken, self._unposted_logprobs[:] = list(self._unposted_logprobs), []
        return taken

    def _on_token(self, token: int) -> bool:
        text = self.stream.push(token)
        if text:
            self._post(("text", text, self._take_unposted()))
        return self.stream.stop is not None

    def _on_finish(self, completion: Completion):
        if self.on_done is not None:
            self.on_done(completion)
        if completion.finish_reason == GRAMMAR_DEAD_END:
            self._post(("error", GrammarDeadEnd(f"after {len(completion.tokens)} tokens, " + DEAD_END_MESSAGE)))
            return
        self._post(("done", completion, self.stream.finish(), self._take_unposted()))

    def _on_error(self, error: BaseException):
        if self.on_done is not None:
            self.on_done(Completion([], "error", len(self.prompt.tokens)))
        self._post(("error", error))

    # ---------------------------------------------------------------- event loop
    def cancel(self):
        self.job.cancelled = True

    async def pieces(self, disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Parsed]:
        """Parsed output as it comes; `self.completion` is set once it ends. With `disconnected`, a client that
        went away cancels the job (ClientGone)."""
        try:
            while True:
                try:
                    items = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S if disconnected else None)
                except TimeoutError:
                    if await disconnected():
                        raise ClientGone() from None
                    continue
                texts = [item[1] if item[0] == "text" else item[2] for item in items if item[0] != "error"]
                for item in items:
                    self.logprobs += item[-1] if item[0] != "error" else []
                text = "".join(texts)
                for piece in self.parser.feed(text):  # all the text that came since the last read, as one
                    yield piece
                last = items[-1]
                if last[0] == "error":
                    raise last[1]
                if last[0] == "done":
                    for piece in self.parser.close():
                        yield piece
                    self.completion = last[1]
                    return
        finally:
            if self.completion is None:  # the client left, or the reader stopped early: free the slot
                self.cancel()

    def new_logprobs(self) -> list[TokenLogprobs]:
        """The log-probabilities received since the last call: streamed with the text that came with them."""
        new = self.logprobs[self._logprobs_taken :]
        self._logprobs_taken = len(self.logprobs)
        return new

    @property
    def stop_string(self) -> str | None:
        return self.stream.stop
