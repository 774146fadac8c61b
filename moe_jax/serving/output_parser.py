"""A model's output text split into reasoning, answer and tool calls, as it streams.

How it works and why: docs/INTERNALS.md, moe_jax/serving/output_parser.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from moe_jax.serving.text_stream import partial_prefix_length

THINK = ("<think>", "</think>")
HERMES_TOOL = ("<tool_call>", "</tool_call>")
DEEPSEEK_TOOL = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_INNER = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
FENCED_JSON = re.compile(r"^\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


@dataclass(frozen=True)
class Dialect:
    """Which markup a chat template's model writes."""

    think: bool = False
    tools: tuple[str, str] | None = None

    @classmethod
    def of_template(cls, template: str | None) -> Dialect:
        template = template or ""
        tools = next((m for m in (HERMES_TOOL, DEEPSEEK_TOOL) if m[0] in template), None)
        return cls(think=THINK[1] in template, tools=tools)

    def starts_thinking(self, prompt: str) -> bool:
        """Whether the prompt leaves a thinking block open (the template wrote `<think>` for the model)."""
        return self.think and prompt.rfind(THINK[0]) > prompt.rfind(THINK[1])

    @property
    def markers(self) -> tuple[str, ...]:
        """Every piece of markup the parser reads."""
        inner = DEEPSEEK_INNER if self.tools == DEEPSEEK_TOOL else ()
        return (THINK if self.think else ()) + (self.tools or ()) + inner


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Parsed:
    """One piece of output: text of a kind ("reasoning" or "content"), or a tool call."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


@dataclass
class OutputParser:
    dialect: Dialect
    state: str = "content"  # or "reasoning", "tool"
    buffer: str = ""
    tool_text: list[str] = field(default_factory=list)

    @classmethod
    def for_prompt(cls, dialect: Dialect, prompt: str) -> OutputParser:
        return cls(dialect, "reasoning" if dialect.starts_thinking(prompt) else "content")

    def feed(self, text: str) -> list[Parsed]:
        """Pieces of output that `text` completes (markup that may still be continuing is held back)."""
        self.buffer += text
        out: list[Parsed] = []
        while True:
            closer = self._closer()
            index = self.buffer.find(closer[0]) if closer else -1
            if index < 0:
                keep = partial_prefix_length(self.buffer, [closer[0]] if closer else [])
                self._emit(out, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            self._emit(out, self.buffer[:index])
            self.buffer = self.buffer[index + len(closer[0]) :]
            self._switch(closer[1], out)

    def close(self) -> list[Parsed]:
        """The rest, once the output has ended (an unclosed tool call stays text)."""
        out: list[Parsed] = []
        self._emit(out, self.buffer)
        self.buffer = ""
        if self.state == "tool":
            out.append(Parsed("content", self.dialect.tools[0] + "".join(self.tool_text)))
            self.tool_text = []
        return merge(out)

    def _closer(self) -> tuple[str, str] | None:
        """(the marker that ends this state or starts the next one, the state it leads to): in content the
        earliest of thinking's and tools' openers."""
        if self.state == "reasoning":
            return THINK[1], "content"
        if self.state == "tool":
            return self.dialect.tools[1], "content"
        openers = [(THINK[0], "reasoning")] if self.dialect.think else []
        openers += [(self.dialect.tools[0], "tool")] if self.dialect.tools else []
        found = [(self.buffer.find(m), m, s) for m, s in openers if m in self.buffer]
        if found:
            return min(found)[1:]
        if not openers:
            return None
        # none complete yet: hold back the longest partial one
        return max(openers, key=lambda o: partial_prefix_length(self.buffer, [o[0]]))

    def _switch(self, new_state: str, out: list[Parsed]):
        if self.state == "tool":
            out.extend(self._tool_calls("".join(self.tool_text)))
            self.tool_text = []
        self.state = new_state

    def _emit(self, out: list[Parsed], text: str):
        if not text:
            return
        if self.state == "tool":
            self.tool_text.append(text)
        else:
            out.append(Parsed(self.state, text))

    def _tool_calls(self, body: str) -> list[Parsed]:
        calls = parse_hermes(body) if self.dialect.tools == HERMES_TOOL else parse_deepseek(body)
        if calls is None:  # not a tool call after all: the markup stays in the answer
            return [Parsed("content", self.dialect.tools[0] + body + self.dialect.tools[1])]
        return [Parsed("tool_call", call=c) for c in calls]


def parse_hermes(body: str) -> list[ToolCall] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return [ToolCall(call["name"], arguments)] if isinstance(arguments, dict) else None


def parse_deepseek(body: str) -> list[ToolCall] | None:
    calls = []
    for left, right in DEEPSEEK_CALL.findall(body):
        fenced = FENCED_JSON.match(right)
        name, arguments = (fenced.group(1), fenced.group(2)) if left.strip() == "function" and fenced else (left, right)
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        calls.append(ToolCall(name.strip(), parsed))
    return calls or None


def parse_all(dialect: Dialect, prompt: str, text: str) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, answer, tool calls) of a whole output."""
    parser = OutputParser.for_prompt(dialect, prompt)
    pieces = parser.feed(text) + parser.close()
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    content = "".join(p.text for p in pieces if p.kind == "content")
    return reasoning, content, [p.call for p in pieces if p.kind == "tool_call"]


def merge(pieces: list[Parsed]) -> list[Parsed]:
    """Consecutive text of one kind as one piece (tool calls stay apart)."""
    merged: list[Parsed] = []
    for p in pieces:
        if merged and p.kind != "tool_call" and merged[-1].kind == p.kind:
            merged[-1] = Parsed(p.kind, merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged
