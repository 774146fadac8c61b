"""Stop strings found in streamed text in time proportional to the text, however many stops a request gives.

How it works and why: docs/INTERNALS.md, moe_jax/serving/stop_matcher.py.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    def __init__(self, stops):
        """`stops`: non-empty strings (empty ones are ignored)."""
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._match = [0]  # length of the longest stop that ends at this state (0: none)
        for stop in stops:
            if stop:
                self._add(stop)
        self._link()
        self.state = 0

    def _add(self, stop: str):
        state = 0
        for ch in stop:
            nxt = self._goto[state].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[state][ch] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[state] + 1)
                self._match.append(0)
            state = nxt
        self._match[state] = len(stop)

    def _link(self):
        """Failure links, breadth first: a state's link is the longest proper end of its string that is also a
        state; a state with no stop of its own matches what its link matches (a shorter stop ending there)."""
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self._goto[state].items():
                link = self._fail[state]
                while link and ch not in self._goto[link]:
                    link = self._fail[link]
                target = self._goto[link].get(ch, 0)
                self._fail[child] = 0 if target == child else target  # (a child of the root links to the root)
                if not self._match[child]:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advances over `text`; at the first stop that ends in it, (the index in `text` just past that stop, the
        stop's length), the longest if several end there. The matcher is spent after a match."""
        goto, fail, match = self._goto, self._fail, self._match
        state = self.state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state]:
                self.state = state
                return i + 1, match[state]
        self.state = state
        return None

    @property
    def pending(self) -> int:
        """Characters at the end of the text fed so far that begin some stop string (a proper beginning, unless
        the last feed matched)."""
        return self._depth[self.state]
