"""What the server serves: one loaded model, its engine thread, and how a request becomes a prompt.

Both APIs (OpenAI's and Anthropic's) come here with their requests already translated to chat messages in the
form Hugging Face chat templates take (`role`, string `content`, `tool_calls` with dict arguments,
`reasoning_content`), or to text or token ids; this renders them with the checkpoint's chat template (sandboxed),
checks them against the context, and submits them.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from moe_jax.errors import InputError
from moe_jax.formats.prompts import render_chat
from moe_jax.generation.anchor_cache import AnchorCache, anchor_token_ids
from moe_jax.generation.batch import Completion, Sampling
from moe_jax.serving.generation import Generation, Mailbox, Prompt
from moe_jax.serving.output_parser import Dialect
from moe_jax.serving.scheduler import Scheduler


class ContextTooLong(InputError):
    """A prompt (with the tokens asked for) longer than the served context."""


@dataclass
class Limits:
    max_batch: int = 16
    max_queue: int = 256
    max_model_len: int | None = None  # default: the model's context window
    anchor_cache_bytes: int = 512 << 20


class Service:
    def __init__(self, model, name: str, limits: Limits):
        self.model, self.name, self.limits = model, name, limits
        self.tokenizer = model.tokenizer
        self.context = min(
            limits.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings
        )
        self.anchor_cache = None
        if limits.anchor_cache_bytes > 0 and self.tokenizer is not None:
            anchors = anchor_token_ids(self.tokenizer)
            if anchors:
                self.anchor_cache = AnchorCache(anchors, limits.anchor_cache_bytes)
        self.scheduler = Scheduler(model, limits.max_batch, self.context, self.anchor_cache, limits.max_queue)
        self.dialect = Dialect.of_template(self.tokenizer.chat_template if self.tokenizer else None)
        self.special_ids = special_token_ids(self.tokenizer, keep=self.dialect.markers)
        self.on_finish: Callable[[Completion], None] | None = None  # every generation's end (metrics)
        self._mailbox: Mailbox | None = None  # into the event loop that submits

    def start(self):
        self.scheduler.start()

    def stop(self, timeout_s: float):
        self.scheduler.stop(timeout_s)

    # ---------------------------------------------------------------- prompts
    def chat_prompt(
        self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None
    ) -> tuple[list[int], str]:
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        text = render_chat(self.tokenizer, messages, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def text_prompt(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("text prompts need a tokenizer, and this checkpoint has no tokenizer.json")
        return self.tokenizer.encode(prompt)

    def check_token_ids(self, tokens: list[int]):
        if not tokens:
            raise InputError("the prompt is empty")
        self.model.check_token_ids(tokens)

    def prompt(
        self,
        tokens: list[int],
        text: str | None,
        *,
        max_tokens: int | None,
        sampling: Sampling,
        seed: int | None,
        stops: list[str],
        ignore_eos: bool = False,
    ) -> Prompt:
        """A checked prompt; max_tokens None: whatever the context leaves."""
        self.check_token_ids(tokens)
        room = self.context - len(tokens)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" + {max_tokens} tokens to generate" if max_tokens is not None else ""
            raise ContextTooLong(f"this server's context is {self.context} tokens; the prompt has {len(tokens)}{asked}")
        if any(not s for s in stops):
            raise InputError("a stop string must not be empty")
        return Prompt(
            tokens,
            text,
            max_tokens or room,
            sampling,
            secrets.randbelow(2**31) if seed is None else seed,
            stops,
            frozenset() if ignore_eos else frozenset(self.model.config.eos_token_ids),
        )

    def submit(self, prompt: Prompt, dialect: Dialect | None = None) -> Generation:
        """Starts generating (QueueFull when the queue is full); `dialect`: the markup to parse in the output
        (default: the chat template's). Call from the event loop."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        generation = Generation(prompt, self.decode, dialect or self.dialect, self._mailbox, self.on_finish)
        self.scheduler.submit(generation.job)
        return generation

    def decode(self, tokens: list[int]) -> str:
        """Text of generated tokens: special tokens dropped, except markup the output parser reads (a model
        whose tokenizer makes `<think>` or its tool-call delimiters special tokens still has them parsed)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in tokens if t not in self.special_ids], skip_special_tokens=False)


def special_token_ids(tokenizer, keep=()) -> frozenset[int]:
    """The tokenizer's special tokens but those spelled as in `keep`."""
    if tokenizer is None:
        return frozenset()
    return frozenset(tokenizer.special_token_ids()) - {tokenizer.token_to_id(m) for m in keep}
