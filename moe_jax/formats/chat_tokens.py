"""Chat prompts whose control tokens come from the chat template only, never from what a client wrote.

How it works and why: docs/INTERNALS.md, moe_jax/formats/chat_tokens.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from moe_jax.errors import InputError
from moe_jax.formats.prompts import render_chat

# Supplementary Private Use Area-A: characters no tokenizer gives meaning to and no ordinary text holds
PRIVATE_USE = re.compile("[\U000f0000-\U000ffffd]")
FIRST_PRIVATE = 0xF0000
RENDER_ARGUMENTS = frozenset({"tokenizer", "messages", "add_generation_prompt", "where"})  # render_chat's own
LEAD = "\n"  # text a piece is tokenized after, to tokenize it as the middle of a text (_mid_text_ids)


def chat_token_ids(
    tokenizer, messages: list[dict], template_kwargs: dict | None = None, on_text: Callable[[str], None] | None = None
) -> tuple[list[int], str]:
    """(token ids, rendered text) of `messages` with the checkpoint's chat template (`render_chat`, given
    `template_kwargs`: `tools`, `enable_thinking`, ...), the special tokens in them only those the template wrote.
    `on_text(text)`: called with the rendered text before it is tokenized (a length check that raises)."""
    template_kwargs = dict(template_kwargs or {})
    taken = RENDER_ARGUMENTS & template_kwargs.keys()
    if taken:
        raise InputError(f"template arguments may not set {', '.join(sorted(taken))}")
    specials = tokenizer.special_strings if tokenizer is not None else ()
    quoting = _Quoting(specials, [tokenizer.chat_template, messages, template_kwargs]) if specials else None
    if quoting is not None:
        messages, template_kwargs = quoting.quote(messages), quoting.quote(template_kwargs)
    text = render_chat(tokenizer, messages, **template_kwargs)  # (no tokenizer or no template: it says so)
    quoted = quoting is not None and quoting.placeholders
    if quoted:
        text, spans = quoting.unquote(text)
    if on_text is not None:
        on_text(text)
    if quoted:
        return _ids_with_spans_as_text(tokenizer, text, spans), text
    return tokenizer.encode(text, add_special_tokens=False), text


class _Quoting:
    """Special-token strings in client data swapped for private-use placeholders, one per distinct string."""

    def __init__(self, specials: tuple[str, ...], everything_given):
        self.pattern = re.compile("|".join(re.escape(s) for s in specials))  # longest first: the longest wins
        self.taken = {ord(c) for s in _strings(everything_given) for c in PRIVATE_USE.findall(s)}
        self.placeholders: dict[str, str] = {}  # special string -> its placeholder
        self.next_code = FIRST_PRIVATE

    def quote(self, value):
        if isinstance(value, str):
            return self.pattern.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {self.quote(k): self.quote(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.quote(v) for v in value]
        return value

    def _placeholder(self, match: re.Match) -> str:
        special = match.group(0)
        if special not in self.placeholders:
            while self.next_code in self.taken:
                self.next_code += 1
            self.placeholders[special] = chr(self.next_code)
            self.next_code += 1
        return self.placeholders[special]

    def unquote(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """The text with each placeholder back as its special string, and those strings' character spans."""
        specials = {p: s for s, p in self.placeholders.items()}
        pieces, spans, at, length = [], [], 0, 0
        for match in re.finditer("|".join(specials), text):
            before = text[at : match.start()]
            special = specials[match.group(0)]
            pieces += [before, special]
            length += len(before)
            spans.append((length, length + len(special)))
            length += len(special)
            at = match.end()
        pieces.append(text[at:])
        return "".join(pieces), spans


def _ids_with_spans_as_text(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """`text`'s token ids, each special token that overlaps one of `spans` (sorted) replaced by its characters'
    ids as plain text (the tokenizer splits special tokens out before anything else, so the text around them
    tokenizes as it would around the special token)."""
    special_ids = set(tokenizer.special_token_ids())
    ids, offsets = tokenizer.encode_with_offsets(text)
    out, span = [], 0
    for token, (start, end) in zip(ids, offsets, strict=True):
        while span < len(spans) and spans[span][1] <= start:
            span += 1
        client_wrote = span < len(spans) and spans[span][0] < end
        if token in special_ids and client_wrote:
            out += _mid_text_ids(tokenizer, text[start:end])
        else:
            out.append(token)
    return out


def _mid_text_ids(tokenizer, piece: str) -> list[int]:
    """`piece`'s ids as plain text that follows other text: tokenized after a newline, whose ids are then taken
    off (a SentencePiece-style tokenizer marks the start of a text with a space of its own, which a piece in the
    middle of a prompt does not have); on its own where the newline's ids do not stay apart."""
    lead = tokenizer.encode_text(LEAD, add_special_tokens=False)
    both = tokenizer.encode_text(LEAD + piece, add_special_tokens=False)
    if both[: len(lead)] == lead:
        return both[len(lead) :]
    return tokenizer.encode_text(piece, add_special_tokens=False)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)
