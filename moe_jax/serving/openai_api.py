"""OpenAI's chat completions and completions: request bodies, and answers whole or as server-sent chunks.

Fields follow the OpenAI API reference; `top_k`, `ignore_eos`, `chat_template_kwargs` (e.g.
`{"enable_thinking": false}`) and `cache_salt` are the extensions vLLM also takes, and `/v1/completions` takes
`parse_special_tokens` (a prompt's special-token strings read as those tokens; by default a prompt is text).
`logit_bias` and the presence and frequency penalties are applied on the host. Every field is honoured or refused
with a 400 naming it: what moe_jax cannot do (n > 1, logprobs, structured output, audio) is never ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moe_jax.errors import InputError
from moe_jax.generation.batch import Sampling
from moe_jax.serving.event_stream import TEXT_SLOT, data_event, text_events
from moe_jax.serving.output_parser import Parsed, ToolCall

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# fields that ask for what this server does not do: refused (with what to do instead) when their value asks for it
UNSUPPORTED = {
    "n": (lambda v: v not in (None, 1), "n must be 1; ask again for another choice"),
    "best_of": (lambda v: v not in (None, 1), "best_of must be 1"),
    "logprobs": (lambda v: v not in (None, False, 0), "no log probabilities are returned"),
    "top_logprobs": (lambda v: v not in (None, 0), "no log probabilities are returned"),
    "echo": (bool, "the prompt is not echoed"),
    "suffix": (bool, "no insertion: give the whole prompt"),
    "response_format": (lambda v: v is not None and v != {"type": "text"}, "no constrained output: only text"),
    "functions": (lambda v: v is not None, "give `tools` instead"),
    "function_call": (lambda v: v is not None, "give `tool_choice` instead"),
    "audio": (lambda v: v is not None, "text only"),
    "modalities": (lambda v: v not in (None, ["text"]), "text only"),
    "prediction": (lambda v: v is not None, "no predicted outputs"),
    "web_search_options": (lambda v: v is not None, "no web search"),
}
MAX_LOGIT_BIAS = 300  # entries a request's logit_bias may hold (OpenAI's own bound)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields that change nothing here (user, metadata...)

    model: str
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
        return Sampling(self.temperature, self.top_p, self.top_k, bias, self.presence_penalty, self.frequency_penalty)

    def checked_prompt(self, service, tokens: list[int], text: str | None, max_tokens: int | None, scope: bytes):
        """The checked prompt (`Service.prompt`) of `tokens` with this request's settings."""
        return service.prompt(
            tokens,
            text,
            max_tokens=max_tokens,
            sampling=self.sampling,
            seed=self.seed,
            stops=self.stops,
            ignore_eos=self.ignore_eos,
            cache_scope=scope,
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


def usage(completion) -> dict:
    n_prompt, n_out = completion.prompt_tokens, len(completion.tokens)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": completion.reused_tokens},
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


def chat_answer(request_id: str, model: str, pieces: list[Parsed], completion) -> dict:
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    calls = [p.call for p in pieces if p.kind == "tool_call"]
    message = {"role": "assistant", "content": "".join(p.text for p in pieces if p.kind == "content")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(completion, calls)}],
        "usage": usage(completion),
    }


def completion_answer(request_id: str, model: str, text: str, completion) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": FINISH_REASONS[completion.finish_reason]}],
        "usage": usage(completion),
    }


class ChatChunks:
    """The `chat.completion.chunk` events of one streamed answer."""

    def __init__(self, request_id: str, model: str):
        self.base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self.calls = 0
        self.text_event = {
            kind: text_events(self.chunk({field: TEXT_SLOT}))
            for kind, field in (("content", "content"), ("reasoning", "reasoning_content"))
        }

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def first(self) -> bytes:
        return data_event(self.chunk({"role": "assistant", "content": ""}))

    def piece(self, p: Parsed) -> bytes:
        if p.kind == "tool_call":
            self.calls += 1
            return data_event(self.chunk({"tool_calls": [tool_call_json(p.call, self.calls - 1)]}))
        return self.text_event[p.kind](p.text)

    def last(self, completion) -> bytes:
        return data_event(self.chunk({}, "tool_calls" if self.calls else FINISH_REASONS[completion.finish_reason]))

    def usage(self, completion) -> bytes:
        return data_event({**self.base, "choices": [], "usage": usage(completion)})


class CompletionChunks:
    """The `text_completion` events of one streamed completion."""

    def __init__(self, request_id: str, model: str):
        self.base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self.text = text_events(self.chunk(TEXT_SLOT))

    def chunk(self, text: str, finish: str | None = None) -> dict:
        return {**self.base, "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    def last(self, completion, include_usage: bool) -> bytes:
        last = self.chunk("", FINISH_REASONS[completion.finish_reason])
        if include_usage:
            last["usage"] = usage(completion)
        return data_event(last)
