"""What the server serves: one loaded model, its engine thread, and how a request becomes a prompt.

Both APIs (OpenAI's and Anthropic's) come here with their requests already translated to chat messages in the
form Hugging Face chat templates take (`role`, string `content`, `tool_calls` with dict arguments,
`reasoning_content`), or to text or token ids; this renders them with the checkpoint's chat template (sandboxed),
checks them against the context, and submits them.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from moe_jax.errors import InputError
from moe_jax.formats.chat_tokens import chat_token_ids
from moe_jax.generation.anchor_cache import AnchorCache, anchor_token_ids
from moe_jax.generation.batch import Completion, Sampling
from moe_jax.generation.constraint import Constraint, GrammarVocabulary
from moe_jax.serving.generation import Generation, Mailbox, Prompt
from moe_jax.serving.output_parser import Dialect
from moe_jax.serving.scheduler import Scheduler

MAX_STOPS = 64  # stop strings a request may give, and their length: the OpenAI API takes 4, llama.cpp and
MAX_STOP_CHARS = 1024  # vLLM any; matching is linear in the text, so this bounds only the automaton's size
BYTES_PER_CHAR = 12  # the most JSON bytes one character of text can take (an escaped surrogate pair)
BODY_OVERHEAD = 64 << 10  # room in a request body for what is not prompt text (keys, settings)
PROMPT_THREADS = 2  # threads that render and tokenize prompts, off the event loop
PROBE_CHARS_PER_TOKEN = 4  # a prompt longer than context x this is first tokenized that far, to refuse it early
PROBE_SLACK = 16  # tokens a cut prefix may count beyond the whole text's tokenization of it (a split last word)


class ContextTooLong(InputError):
    """A prompt (with the tokens asked for) longer than the served context."""


@dataclass
class Limits:
    max_batch: int = 16
    max_queue: int = 256
    max_model_len: int | None = None  # default: the model's context window
    anchor_cache_bytes: int = 512 << 20
    max_prompt_chars: int | None = None  # default: the context times the longest token's characters
    draft_tokens: int = 0  # speculative decoding of greedy requests: the most prompt-lookup drafts a step (0: off)


class Service:
    def __init__(self, model, name: str, limits: Limits):
        if name in model.served_adapters:
            raise InputError(f"the served model's name {name!r} is also an adapter's: a request could mean either")
        self.model, self.name, self.limits = model, name, limits
        self.started = int(time.time())  # the model card's `created`
        self.tokenizer = model.tokenizer
        self.context = min(
            limits.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings
        )
        self.anchor_cache = None
        if limits.anchor_cache_bytes > 0 and self.tokenizer is not None:
            anchors = anchor_token_ids(self.tokenizer)
            if anchors:
                self.anchor_cache = AnchorCache(anchors, limits.anchor_cache_bytes)
        self.scheduler = Scheduler(
            model, limits.max_batch, self.context, self.anchor_cache, limits.max_queue, limits.draft_tokens
        )
        self.dialect = Dialect.of_template(self.tokenizer.chat_template if self.tokenizer else None)
        self.special_ids = special_token_ids(self.tokenizer, keep=self.dialect.markers)
        self.max_prompt_chars = limits.max_prompt_chars or self.context * longest_token_chars(self.tokenizer)
        # a body larger than this holds more text than any prompt that fits: refused before it is read or parsed
        self.max_body_bytes = BYTES_PER_CHAR * self.max_prompt_chars + BODY_OVERHEAD
        self.on_finish: Callable[[Completion], None] | None = None  # every generation's end (metrics)
        self._mailbox: Mailbox | None = None  # into the event loop that submits
        self._prompt_threads = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="moe_jax-prompt")

    def start(self):
        self.scheduler.start()

    def begin_stop(self, timeout_s: float):
        """Refuses new and waiting requests (503) from now on; running ones get `timeout_s` to finish."""
        self.scheduler.begin_stop(timeout_s)

    def stop(self, timeout_s: float):
        self.scheduler.stop(timeout_s)
        self._prompt_threads.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- prompts
    async def off_loop(self, prepare: Callable, *args):
        """`prepare(*args)` on a prompt thread: rendering and tokenizing a long prompt takes long enough to stall
        every stream the event loop serves."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_threads, prepare, *args)

    def chat_prompt(
        self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None
    ) -> tuple[list[int], str]:
        """(token ids, rendered text) of a conversation; only the template writes control tokens."""
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        return chat_token_ids(self.tokenizer, messages, extra, on_text=self.check_length)

    def text_prompt(self, prompt: str, special_tokens: bool = False) -> list[int]:
        """`prompt`'s token ids: as plain text, or with `special_tokens` its special-token strings as the tokens."""
        if self.tokenizer is None:
            raise InputError("text prompts need a tokenizer, and this checkpoint has no tokenizer.json")
        self.check_length(prompt)
        return self.tokenizer.encode(prompt) if special_tokens else self.tokenizer.encode_text(prompt)

    def check_length(self, text: str):
        """ContextTooLong for a text that cannot fit the context, found without tokenizing all of it: one longer
        than `max_prompt_chars` needs more tokens than the context holds, and one whose first part alone already
        does is refused without tokenizing the rest."""
        if len(text) > self.max_prompt_chars:
            raise ContextTooLong(
                f"the prompt is {len(text)} characters; this server's context of {self.context} tokens takes at "
                f"most {self.max_prompt_chars}"
            )
        probe = self.context * PROBE_CHARS_PER_TOKEN
        if len(text) > probe:
            n = len(self.tokenizer.encode(text[:probe], add_special_tokens=False))
            if n > self.context + PROBE_SLACK:
                raise ContextTooLong(
                    f"this server's context is {self.context} tokens; the prompt's first {probe} characters alone "
                    f"are {n}"
                )

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
        cache_scope: bytes = b"",
        constraint: Constraint | None = None,
        adapter: int = 0,
    ) -> Prompt:
        """A checked prompt; max_tokens None: whatever the context leaves; `cache_scope`: the anchor cache
        entries it may read and write (see `cache_scope()`); `constraint`: the grammar its output keeps to
        (`output_constraint`); `adapter`: the served adapter it runs through (`model_choice`; 0: none)."""
        self.check_token_ids(tokens)
        vocab = self.model.config.vocab_size
        for token, _ in sampling.logit_bias:
            if not 0 <= token < vocab:
                raise InputError(f"logit_bias: token {token} is not in the vocabulary (0 to {vocab - 1})")
        room = self.context - len(tokens)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" + {max_tokens} tokens to generate" if max_tokens is not None else ""
            raise ContextTooLong(f"this server's context is {self.context} tokens; the prompt has {len(tokens)}{asked}")
        if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise InputError(
                f"stop strings: at most {MAX_STOPS}, each 1 to {MAX_STOP_CHARS} characters "
                f"(got {len(stops)}, the longest {max(map(len, stops))} characters)"
            )
        return Prompt(
            tokens,
            text,
            max_tokens or room,
            sampling,
            secrets.randbelow(2**31) if seed is None else seed,
            stops,
            frozenset() if ignore_eos else frozenset(self.model.config.eos_token_ids),
            cache_scope,
            constraint,
            adapter,
        )

    def output_constraint(self, grammar: str) -> Constraint:
        """The constraint at the start of `grammar` (generation.constraint); slow for large grammars: call it
        off the event loop (`off_loop`)."""
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: its output cannot be held to a grammar")
        return self._grammar_vocabulary.compile(grammar)

    @functools.cached_property
    def _grammar_vocabulary(self) -> GrammarVocabulary:
        return GrammarVocabulary(self.tokenizer, self.model.config.vocab_size, self.model.config.eos_token_ids)

    def submit(self, prompt: Prompt, dialect: Dialect | None = None) -> Generation:
        """Starts generating (QueueFull when the queue is full); `dialect`: the markup to parse in the output
        (default: the chat template's). Call from the event loop."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        generation = Generation(prompt, self.decode, dialect or self.dialect, self._mailbox, self.on_finish)
        self.scheduler.submit(generation.job)
        return generation

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (what log-probabilities are reported under)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        """Text of generated tokens: special tokens dropped, except markup the output parser reads (a model
        whose tokenizer makes `<think>` or its tool-call delimiters special tokens still has them parsed)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in tokens if t not in self.special_ids], skip_special_tokens=False)


def cache_scope(api_key: str | None, cache_salt: str | None) -> bytes:
    """The anchor cache scope of a request: its API key's and its `cache_salt`'s (empty: the one shared scope of
    a server without keys, for requests without a salt)."""
    if api_key is None and cache_salt is None:
        return b""
    return hashlib.blake2b(json.dumps([api_key, cache_salt]).encode(), digest_size=32).digest()


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: a vocabulary entry's length bounds its text's (byte-level
    and byte-fallback entries spell a byte with one character or more)."""
    if tokenizer is None:
        return 1
    return max(len(t) for t in tokenizer.vocabulary())


def special_token_ids(tokenizer, keep=()) -> frozenset[int]:
    """The tokenizer's special tokens but those spelled as in `keep`."""
    if tokenizer is None:
        return frozenset()
    return frozenset(tokenizer.special_token_ids()) - {tokenizer.token_to_id(m) for m in keep}
