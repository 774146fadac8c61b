"""Generated tokens to text as they come: incremental detokenization and stop strings.

How it works and why: docs/INTERNALS.md, moe_jax/serving/text_stream.py.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_jax.serving.stop_matcher import StopMatcher

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] = ()):
        self.decode = decode
        self.matcher = StopMatcher(stops)
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window decoded for context starts here
        self.read_offset = 0  # tokens before this are in `text`
        self.text = ""  # decoded so far (released or held back), cut at a stop string
        self.released = 0  # characters of `text` handed out
        self.stop: str | None = None  # the stop string that ended the text

    def push(self, token: int) -> str:
        """Takes one token; returns the text that can be released now (possibly empty)."""
        if self.stop is not None:
            return ""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self.decode(self.tokens[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            new_from = len(self.text)
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self._find_stop(new_from)
        return self._release(self.text if self.stop is not None else self.text[: len(self.text) - self._held()])

    def finish(self) -> str:
        """The text still held back (the sequence has ended)."""
        return self._release(self.text)

    def _find_stop(self, new_from: int):
        """Feeds the text from `new_from` (what the last token added) to the stop matcher; cuts it at a stop."""
        found = self.matcher.feed(self.text[new_from:])
        if found is not None:
            end, length = found
            start = new_from + end - length
            self.stop, self.text = self.text[start : new_from + end], self.text[:start]

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (and so are not released yet)."""
        return min(self.matcher.pending, len(self.text) - self.released)

    def _release(self, upto: str) -> str:
        out = upto[self.released :]
        self.released = max(self.released, len(upto))
        return out


def partial_prefix_length(text: str, markers) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
