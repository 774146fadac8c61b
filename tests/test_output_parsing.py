"""The server's text path without a server: incremental detokenization with stop strings, and the parser that
splits output into reasoning, answer and tool calls, fed whole or a character at a time."""

from __future__ import annotations

import json

import pytest

from moe_jax.serving.event_stream import data_event
from moe_jax.serving.openai_api import ChatChunks, CompletionChunks
from moe_jax.serving.output_parser import Dialect, OutputParser, Parsed, ToolCall, parse_all
from moe_jax.serving.text_stream import TextStream

QWEN = Dialect.of_template("... <think> </think> ... <tool_call> </tool_call>")
DEEPSEEK = Dialect.of_template("<｜Assistant｜><think>\n ... </think> <｜tool▁calls▁begin｜>")


def byte_decoder(pieces: list[bytes]):
    """A decoder over byte pieces, as byte-level tokenizers decode: an incomplete character is U+FFFD."""
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


def stream_all(stream: TextStream, n: int) -> list[str]:
    return [stream.push(i) for i in range(n)] + [stream.finish()]


def test_text_stream_waits_for_whole_characters():
    word = "naïve ☕".encode()
    pieces = [word[i : i + 1] for i in range(len(word))]  # one byte a token: characters split over tokens
    out = stream_all(TextStream(byte_decoder(pieces)), len(pieces))
    assert "".join(out) == "naïve ☕"
    assert all("\ufffd" not in piece for piece in out)


@pytest.mark.parametrize(
    "stops, expected, stop",
    [
        (["STOP"], "hello world ", "STOP"),
        (["wor", "STOP"], "hello ", "wor"),  # the earliest stop wins
        (["xyz"], "hello world STOP more", None),
        (["more"], "hello world STOP ", "more"),
    ],
)
def test_text_stream_stops_at_the_first_stop_string(stops, expected, stop):
    text = "hello world STOP more"
    pieces = [text[i : i + 3].encode() for i in range(0, len(text), 3)]  # stops straddle token boundaries
    stream = TextStream(byte_decoder(pieces), stops)
    out = stream_all(stream, len(pieces))
    assert "".join(out) == expected and stream.stop == stop
    assert all(not any(s in piece for s in stops) for piece in out)


def test_text_stream_holds_back_a_possible_stop_start():
    pieces = [b"ab", b"c", b"S", b"T", b"x"]
    stream = TextStream(byte_decoder(pieces), ["STOP"])
    assert [stream.push(i) for i in range(5)] == ["ab", "c", "", "", "STx"]


def pieces_of(dialect, prompt, text, one_char_at_a_time):
    parser = OutputParser.for_prompt(dialect, prompt)
    feeds = list(text) if one_char_at_a_time else [text]
    out = [p for f in feeds for p in parser.feed(f)] + parser.close()
    reasoning = "".join(p.text for p in out if p.kind == "reasoning")
    content = "".join(p.text for p in out if p.kind == "content")
    return reasoning, content, [p.call for p in out if p.kind == "tool_call"]


@pytest.mark.parametrize("one_char_at_a_time", [False, True])
def test_qwen_thinking_and_tool_calls(one_char_at_a_time):
    text = (
        '<think>the user wants the weather</think>Let me look.<tool_call>\n{"name": "weather", "arguments": '
        '{"city": "Oslo"}}\n</tool_call><tool_call>{"name": "time", "arguments": "{\\"tz\\": 1}"}</tool_call>'
    )
    assert pieces_of(QWEN, "", text, one_char_at_a_time) == (
        "the user wants the weather",
        "Let me look.",
        [ToolCall("weather", {"city": "Oslo"}), ToolCall("time", {"tz": 1})],
    )


@pytest.mark.parametrize("one_char_at_a_time", [False, True])
def test_deepseek_thinking_opened_by_the_template_and_both_call_formats(one_char_at_a_time):
    prompt = "<｜User｜>hi<｜Assistant｜><think>\n"
    text = (
        "I should call it.</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n"
        '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>{"tz": 1}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert pieces_of(DEEPSEEK, prompt, text, one_char_at_a_time) == (
        "I should call it.",
        "Sure.",
        [ToolCall("weather", {"city": "Oslo"}), ToolCall("time", {"tz": 1})],
    )


def test_markup_that_does_not_parse_stays_text():
    assert parse_all(QWEN, "", "a <tool_call>not json</tool_call> b") == (
        "",
        "a <tool_call>not json</tool_call> b",
        [],
    )
    assert parse_all(QWEN, "", "a <tool_call>{unclosed") == ("", "a <tool_call>{unclosed", [])
    assert parse_all(QWEN, "", "less < than <thin") == ("", "less < than <thin", [])


def test_a_template_without_markup_parses_nothing():
    plain = Dialect.of_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    text = "<think>x</think><tool_call>{}</tool_call>"
    assert plain.markers == ()
    assert parse_all(plain, "<think>", text) == ("", text, [])


@pytest.mark.parametrize("text", ["", "plain", 'quote " and \\ back', "line\nbreak\ttab", "é中😀", "\x00\x1f", "</s>"])
def test_streamed_text_events_equal_the_whole_chunk_serialized(text):
    """The per-token events written around a prebuilt JSON frame are the bytes json.dumps of the chunk gives."""
    chat = ChatChunks("chatcmpl-1", "m")
    for kind, field in (("content", "content"), ("reasoning", "reasoning_content")):
        assert chat.piece(Parsed(kind, text)) == data_event(chat.chunk({field: text}))
    completion = CompletionChunks("cmpl-1", "m")
    assert completion.piece(Parsed("content", text)) == data_event(completion.chunk(text))
    event = json.loads(completion.piece(Parsed("content", text)).removeprefix(b"data: "))
    assert event["choices"][0]["text"] == text and event["id"] == "cmpl-1"
