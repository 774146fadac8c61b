"""Anthropic's Messages API: request bodies, and answers whole or as the streamed event sequence.

Content blocks map onto the chat template's messages: text is content, `thinking` is the assistant's
`reasoning_content`, `tool_use` blocks are `tool_calls`, `tool_result` blocks become `tool` messages. Usage counts
prompt tokens read from the anchor cache as `cache_read_input_tokens` and the rest as `input_tokens`, as
Anthropic counts its own prompt cache.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moe_jax.errors import InputError
from moe_jax.generation.batch import Sampling
from moe_jax.serving.openai_api import new_id
from moe_jax.serving.output_parser import Parsed, merge

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    input_schema: dict = Field(default_factory=dict)


class CountTokensRequest(BaseModel):
    """What `/v1/messages/count_tokens` takes: the prompt part of a Messages request."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # the served model when left out; a served adapter's name, or <model>:<adapter>
    adapter: str | None = Field(None, max_length=128)  # a served adapter (--lora-modules), as `model` can name one
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None

    def template_kwargs(self) -> dict:
        """Extended thinking on or off, for templates that take `enable_thinking` (others ignore it)."""
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.get("type") == "enabled"}

    @property
    def stops(self) -> list[str]:
        return self.stop_sequences or []

    def template_tools(self) -> list[dict] | None:
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
            return None
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in self.tools
        ]

    def template_messages(self) -> list[dict]:
        out = []
        if self.system:
            out.append({"role": "system", "content": _texts(self.system, "system")})
        for i, m in enumerate(self.messages):
            out += _template_messages(i, m)
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    cache_salt: str | None = Field(None, max_length=256)  # the anchor cache scope beside the API key's (as vLLM's)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)


def _texts(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where}: content must be a string or a list of blocks, got {type(content).__name__}")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InputError(f"{where}: a {kind!r} block is not supported here")
        parts.append(_field(block, "text", str, where))
    return "".join(parts)


def _field(block: dict, key: str, kind, where: str, default=None):
    """`block[key]`, which must be of `kind` (a missing key: `default`, which must be too)."""
    value = block.get(key, default)
    if not isinstance(value, kind):
        raise InputError(
            f"{where}: a {block.get('type')!r} block's {key!r} must be {getattr(kind, '__name__', kind)}, got "
            f"{type(value).__name__}"
        )
    return value


def _template_messages(index: int, m: AnthropicMessage) -> list[dict]:
    where = f"messages[{index}]"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    message = {"role": m.role, "content": ""}
    tool_messages = []
    for block in m.content:
        kind = block.get("type")
        if kind == "text":
            message["content"] += _field(block, "text", str, where)
        elif kind == "thinking" and m.role == "assistant":
            thinking = _field(block, "thinking", str, where)
            message["reasoning_content"] = message.get("reasoning_content", "") + thinking
        elif kind == "redacted_thinking" and m.role == "assistant":
            continue
        elif kind == "tool_use" and m.role == "assistant":
            call = {
                "id": _field(block, "id", str, where, ""),
                "type": "function",
                "function": {
                    "name": _field(block, "name", str, where),
                    "arguments": _field(block, "input", dict, where, {}),
                },
            }
            message.setdefault("tool_calls", []).append(call)
        elif kind == "tool_result" and m.role == "user":
            tool_messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(block, "tool_use_id", str, where, ""),
                    "content": _texts(block.get("content", ""), f"{where} tool_result"),
                }
            )
        else:
            raise InputError(f"{where}: a {kind!r} block is not supported in a {m.role} message here")
    has_own = message["content"] or "tool_calls" in message or "reasoning_content" in message
    return tool_messages + ([message] if has_own or not tool_messages else [])


# ---------------------------------------------------------------------------------------------- answers
def usage(completion) -> dict:
    return {
        "input_tokens": completion.prompt_tokens - completion.reused_tokens,
        "output_tokens": len(completion.tokens),
        "cache_read_input_tokens": completion.reused_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(completion, has_calls: bool) -> str:
    return "tool_use" if has_calls else STOP_REASONS[completion.finish_reason]


def block_of(p: Parsed) -> dict:
    if p.kind == "tool_call":
        return {"type": "tool_use", "id": new_id("toolu_"), "name": p.call.name, "input": p.call.arguments}
    if p.kind == "reasoning":
        return {"type": "thinking", "thinking": p.text, "signature": ""}
    return {"type": "text", "text": p.text}


def message_answer(message_id: str, model: str, pieces: list[Parsed], completion, stop: str | None) -> dict:
    blocks = merge(pieces)  # consecutive text of one kind is one block
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block_of(p) for p in blocks],
        "stop_reason": stop_reason(completion, any(p.kind == "tool_call" for p in blocks)),
        "stop_sequence": stop if completion.finish_reason == "stop" else None,
        "usage": usage(completion),
    }


class MessageEvents:
    """The server-sent events of one streamed message: (event name, data) pairs."""

    def __init__(self, message_id: str, model: str):
        self.message_id, self.model = message_id, model
        self.index = -1
        self.open_kind: str | None = None
        self.has_calls = False

    def start(self, prompt_tokens: int, reused: int) -> list[tuple[str, dict]]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens - reused,
                "output_tokens": 0,
                "cache_read_input_tokens": reused,
                "cache_creation_input_tokens": 0,
            },
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def piece(self, p: Parsed) -> list[tuple[str, dict]]:
        events = []
        if p.kind != self.open_kind or p.kind == "tool_call":
            events += self._close_block()
            self.index += 1
            block = block_of(p)
            if p.kind == "tool_call":
                self.has_calls = True
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(p.call.arguments, ensure_ascii=False)}
            elif p.kind == "reasoning":
                start, delta = {**block, "thinking": ""}, {"type": "thinking_delta", "thinking": p.text}
            else:
                start, delta = {**block, "text": ""}, {"type": "text_delta", "text": p.text}
            events.append(
                ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": start})
            )
            self.open_kind = p.kind
        elif p.kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": p.text}
        else:
            delta = {"type": "text_delta", "text": p.text}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return events

    def _close_block(self) -> list[tuple[str, dict]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def end(self, completion, stop: str | None) -> list[tuple[str, dict]]:
        delta = {
            "stop_reason": stop_reason(completion, self.has_calls),
            "stop_sequence": stop if completion.finish_reason == "stop" else None,
        }
        return self._close_block() + [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(completion)}),
            ("message_stop", {"type": "message_stop"}),
        ]
