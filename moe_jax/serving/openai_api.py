"""OpenAI's chat completions and completions: request bodies, and answers whole or as server-sent chunks.

How it works and why: docs/INTERNALS.md, moe_jax/serving/openai_api.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moe_jax.errors import InputError
from moe_jax.generation.batch import Sampling
from moe_jax.generation.constraint import lark_grammar, schema_of_response_format
from moe_jax.generation.sampling import TokenLogprobs
from moe_jax.serving.event_stream import TEXT_SLOT, data_event, text_events
from moe_jax.serving.output_parser import Parsed, ToolCall

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# fields that ask for what this server does not do: refused (with what to do instead) when their value asks for it
UNSUPPORTED = {
    "best_of": (lambda v: v not in (None, 1), "best_of must be 1"),
    "echo": (bool, "the prompt is not echoed"),
    "suffix": (bool, "no insertion: give the whole prompt"),
    "functions": (lambda v: v is not None, "give `tools` instead"),
    "function_call": (lambda v: v is not None, "give `tool_choice` instead"),
    "audio": (lambda v: v is not None, "text only"),
    "modalities": (lambda v: v not in (None, ["text"]), "text only"),
    "prediction": (lambda v: v is not None, "no predicted outputs"),
    "web_search_options": (lambda v: v is not None, "no web search"),
}
MAX_LOGIT_BIAS = 300  # entries a request's logit_bias may hold (OpenAI's own bound)
MAX_GRAMMAR_CHARS = 256 << 10  # a grammar's text; llguidance bounds the work it can ask for (constraint.LIMITS)
MAX_CHOICES = 16  # the most choices (n) one request may ask for: each takes a batch slot
MAX_TOP_LOGPROBS = 20  # the most likely tokens a request may ask to see at each position (OpenAI's chat bound)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields that change nothing here (user, metadata...)

    model: str | None = None  # the served model when left out; a served adapter's name, or <model>:<adapter>
    adapter: str | None = Field(None, max_length=128)  # a served adapter (--lora-modules), as `model` can name one
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    cache_salt: str | None = Field(None, max_length=256)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choice i samples with seed + i: n requests seeded so give the same
    response_format: dict | None = None
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)  # a Lark grammar (llguidance's), as vLLM's

    def output_grammar(self) -> str | None:
        """The grammar the output must keep to (`response_format` or `grammar`), or None for free text."""
        from_format = schema_of_response_format(self.response_format)
        if from_format is not None and self.grammar is not None:
            raise InputError("give response_format or grammar, not both")
        return lark_grammar(self.grammar) if self.grammar is not None else from_format

    def check(self):
        """A 400 naming the first field that asks for what this server does not do."""
        given = self.model_extra or {}
        for name, (refused, instead) in UNSUPPORTED.items():
            if name in given and refused(given[name]):
                raise InputError(f"{name}={json.dumps(given[name])[:80]} is not supported by this server: {instead}")

    @property
    def sampling(self) -> Sampling:
        bias = ()
        for token, value in (self.logit_bias or {}).items():
            if not token.isdigit() or not -100 <= value <= 100:
                raise InputError(f"logit_bias: keys are token ids and values in [-100, 100], got {token!r}: {value}")
            bias += ((int(token), value),)
        return Sampling(
            self.temperature,
            self.top_p,
            self.top_k,
            bias,
            self.presence_penalty,
            self.frequency_penalty,
            self.logprob_count,
        )

    @property
    def logprob_count(self) -> int | None:
        """The top tokens to report at each position (0: only the chosen one's), or None for no logprobs."""
        return None

    def checked_prompt(
        self,
        service,
        tokens: list[int],
        text: str | None,
        max_tokens: int | None,
        scope: bytes,
        constraint=None,
        adapter: int = 0,
    ):
        """The checked prompt (`Service.prompt`) of `tokens` with this request's settings, through served adapter
        `adapter` (0: none)."""
        return service.prompt(
            tokens,
            text,
            max_tokens=max_tokens,
            sampling=self.sampling,
            seed=self.seed,
            stops=self.stops,
            ignore_eos=self.ignore_eos,
            cache_scope=scope,
            constraint=constraint,
            adapter=adapter,
        )

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    name: str | None = None


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    chat_template_kwargs: dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InputError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        """The messages as Hugging Face chat templates take them."""
        return [_template_message(i, m) for i, m in enumerate(self.messages)]

    @property
    def template_tools(self) -> list[dict] | None:
        if self.tool_choice == "none" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    parse_special_tokens: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InputError(f"one prompt per request here, got {len(prompt)}")
            prompt = prompt[0]
        return prompt


def _template_message(index: int, m: ChatMessage) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": _text_of(index, m.content)}
    if m.tool_calls:
        out["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    for key in ("tool_call_id", "reasoning_content", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _text_of(index: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InputError(f"messages[{index}]: only text content parts (with a string 'text') are supported")
        texts.append(part.text)
    return "".join(texts)


def _template_tool_call(call: ToolCallIn) -> dict:
    """An OpenAI tool call with its JSON-string arguments as a dict, as chat templates expect them."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass  # kept as the string it is: templates print either
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    return out if call.id is None else {"id": call.id, **out}


# ---------------------------------------------------------------------------------------------- answers
def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def usage(completions: list) -> dict:
    """The usage of a request's choices: the prompt counted once (as OpenAI counts it), every choice's tokens."""
    n_prompt, n_out = completions[0].prompt_tokens, sum(len(c.tokens) for c in completions)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": completions[0].reused_tokens},
    }


def finish_reason(completion, calls: list) -> str:
    return "tool_calls" if calls else FINISH_REASONS[completion.finish_reason]


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {
        "id": new_id("call_"),
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }
    return out if index is None else {"index": index, **out}


def chat_logprobs(logprobs: list[TokenLogprobs] | None, token_text: Callable[[int], str]) -> dict | None:
    """A chat choice's `logprobs` (None when not asked for)."""
    if logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in logprobs]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprobs] | None, token_text: Callable[[int], str], offset: int = 0):
    """A completion choice's `logprobs` in the legacy layout (None when not asked for); `offset`: the text
    offset of the first token (of this chunk, when streaming)."""
    if logprobs is None:
        return None
    tokens = [token_text(r.token) for r in logprobs]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [r.logprob for r in logprobs],
        "top_logprobs": [{token_text(t): lp for t, lp in r.top} for r in logprobs],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    """One choice's output: its parsed pieces, its completion and its `logprobs` (None when not asked for)."""

    pieces: list[Parsed]
    completion: object
    logprobs: dict | None = None


def chat_answer(request_id: str, model: str, choices: list[Choice]) -> dict:
    out = []
    for index, choice in enumerate(choices):
        pieces = choice.pieces
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
        calls = [p.call for p in pieces if p.kind == "tool_call"]
        message = {"role": "assistant", "content": "".join(p.text for p in pieces if p.kind == "content")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [tool_call_json(c) for c in calls]
        finish = finish_reason(choice.completion, calls)
        out.append({"index": index, "message": message, "logprobs": choice.logprobs, "finish_reason": finish})
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage([c.completion for c in choices]),
    }


def completion_answer(request_id: str, model: str, choices: list[Choice]) -> dict:
    out = [
        {
            "index": index,
            "text": "".join(p.text for p in choice.pieces),
            "logprobs": choice.logprobs,
            "finish_reason": FINISH_REASONS[choice.completion.finish_reason],
        }
        for index, choice in enumerate(choices)
    ]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage([c.completion for c in choices]),
    }


class ChatChunks:
    """The `chat.completion.chunk` events of one streamed answer. `logprobs()`, when asked for, gives the
    `logprobs` of the tokens that arrived since its last call: each chunk carries those its text came with."""

    def __init__(self, request_id: str, model: str, logprobs: Callable[[], dict] | None = None, index: int = 0):
        self.base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self.calls, self.index = 0, index
        self.logprobs = logprobs
        self.text_event = {
            kind: text_events(self.chunk({field: TEXT_SLOT}))
            for kind, field in (("content", "content"), ("reasoning", "reasoning_content"))
        }

    def chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[bytes]:
        """The events before the first piece: the assistant's role."""
        return [data_event(self.chunk({"role": "assistant", "content": ""}))]

    def piece(self, p: Parsed) -> bytes:
        if p.kind == "tool_call":
            self.calls += 1
            delta = {"tool_calls": [tool_call_json(p.call, self.calls - 1)]}
        elif self.logprobs is None:
            return self.text_event[p.kind](p.text)
        else:
            delta = {"content" if p.kind == "content" else "reasoning_content": p.text}
        return data_event(self.chunk(delta, logprobs=self.logprobs() if self.logprobs else None))

    def last(self, completion) -> bytes:
        finish = "tool_calls" if self.calls else FINISH_REASONS[completion.finish_reason]
        return data_event(self.chunk({}, finish, self.logprobs() if self.logprobs else None))

    def usage(self, completions: list) -> bytes:
        return data_event({**self.base, "choices": [], "usage": usage(completions)})


class CompletionChunks:
    """The `text_completion` events of one streamed completion (`logprobs` as ChatChunks', given the text offset
    of its first token)."""

    def __init__(self, request_id: str, model: str, logprobs: Callable[[int], dict] | None = None, index: int = 0):
        self.base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self.logprobs, self.offset, self.index = logprobs, 0, index
        self._text_event = text_events(self.chunk(TEXT_SLOT))

    def chunk(self, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[bytes]:
        return []  # a completion's stream starts with its text

    def piece(self, p: Parsed) -> bytes:
        if self.logprobs is None:
            return self._text_event(p.text)
        return data_event(self.chunk(p.text, logprobs=self._new_logprobs()))

    def _new_logprobs(self) -> dict | None:
        if self.logprobs is None:
            return None
        new = self.logprobs(self.offset)
        self.offset += sum(len(t) for t in new["tokens"])
        return new

    def last(self, completion) -> bytes:
        return data_event(self.chunk("", FINISH_REASONS[completion.finish_reason], self._new_logprobs()))

    def usage(self, completions: list) -> bytes:
        return data_event({**self.base, "choices": [], "usage": usage(completions)})
