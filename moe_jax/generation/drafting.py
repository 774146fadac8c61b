"""Prompt-lookup drafting: the next tokens guessed from the sequence itself, without a draft model.

Agent and editing workloads copy from their context (file paths, code, the lines an edit keeps), so the longest
recent n-gram that ends the sequence has often occurred before, and what followed it then is a good guess of what
follows now. `NgramDrafter` keeps, for each n up to `max_ngram`, where each n-gram last ended, updated token by
token as the sequence grows, so a proposal costs a few dictionary lookups however long the context is.
"""

from __future__ import annotations

MAX_NGRAM = 3  # the longest n-gram matched; shorter ones are tried when it has not occurred before


class NgramDrafter:
    """The drafts of one sequence: `extend` it with each new token (the prompt first), `propose(k)` up to k tokens
    that followed the most recent earlier occurrence of its longest matching suffix."""

    def __init__(self, tokens=(), max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # per n: n-gram -> the index just past its latest occurrence that has a successor (the occurrence ending
        # the sequence is entered only when the next token comes, so a match never points at itself)
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.extend(tokens)

    def extend(self, tokens):
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1  # the n-grams ending just before the new token now have a successor
            for n in range(1, self.max_ngram + 1):
                if end >= n:
                    self.ends[n][tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens (none where no suffix of the sequence occurred before)."""
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            end = self.ends[n].get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end : end + k]
        return []
