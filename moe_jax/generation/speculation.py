"""How wide a speculative call's steps are (1: plain decoding), chosen by the tokens a second each width has
delivered on this machine and workload.

How it works and why: docs/INTERNALS.md, moe_jax/generation/speculation.py.
"""

from __future__ import annotations

from collections import deque

from moe_jax.errors import InputError

MAX_DRAFTS = 15  # the most drafts a row's step verifies
WINDOW = 16  # a width's latest calls, whose rate is its rate
JUDGED_AFTER = 3  # calls of a width (past its first) before its rate is trusted
STALLED_SHARE = 0.25  # of a width's calls, the slowest left out of its rate
MIN_YIELD = 1.2  # tokens a sequence's speculative step must make (a wider step costs more than a plain one)
EXPLORE_EVERY = 64  # decisions between calls of the width tried longest ago (a workload can start or stop copying)
EXPLORING_CALLS = 4  # calls in a row an exploration runs (the first, after a switch, is not counted)

POLICIES = ("cost", "always")


class DraftPolicy:
    """The width of the next call's steps over some rows ("cost"): the width whose calls have delivered the most
    tokens a second over that many rows lately, plain calls (width 1) included, once it has run JUDGED_AFTER calls.
    The next wider width is tried while the widest judged is the best (a wider step costs more, so where one width
    does not beat a narrower one a wider one rarely does); every EXPLORE_EVERY-th decision the width tried longest
    ago runs instead for EXPLORING_CALLS calls, so one that a change of workload made faster is seen. "always": the
    widest step at every call, whatever it costs (to measure acceptance, and for tests)."""

    def __init__(self, max_drafts: int, policy: str = "cost"):
        if not 1 <= max_drafts <= MAX_DRAFTS:
            raise InputError(f"drafts {max_drafts}: from 1 to {MAX_DRAFTS}")
        if policy not in POLICIES:
            raise InputError(f"draft policy {policy!r}: one of {', '.join(POLICIES)}")
        # tokens a row in a step: 1 (a plain step), then powers of two and the widest (each width compiles once)
        self.widths = tuple(sorted({1 << i for i in range(5) if 1 << i <= max_drafts} | {max_drafts + 1}))
        self.always = policy == "always"
        # by (rows, width): each row count is its own compiled step, and costs its own; the first call of each
        # compiled step is left out (it compiles): a single plain step and a block are different ones
        self.calls: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # (tokens, seconds) of the latest
        self.rates: dict[tuple[int, int], float] = {}  # trimmed_rate of those
        # tokens a sequence's step made in those calls (speculative widths): counted, not timed, so free of the
        # machine's noise; a width below MIN_YIELD cannot pay for its wider steps and is not chosen
        self.made: dict[tuple[int, int], deque[tuple[int, int]]] = {}  # (tokens, row_steps) of the latest calls
        self.yields: dict[tuple[int, int], float] = {}
        self.last_tried: dict[tuple[int, int], int] = {}
        self.seen: set[tuple[int, int, bool]] = set()
        # the width of the last call by rows: a call of another width than the one before it runs on caches that
        # held the other step's code and data, slower than that width's calls in a row, and is left out
        self.previous: dict[int, int] = {}
        self.exploring: dict[int, tuple[int, int]] = {}  # rows -> (width explored, calls of it still to run)
        self.decisions = 0

    def observed(self, rows: int, width: int, tokens: int, seconds: float, block: bool = True):
        """A call `width` tokens wide (1: plain) over `rows` rows made `tokens` tokens in `seconds`, the host's
        reading of it in. `block`: the call was a block of steps (a plain call of one step is compiled apart)."""
        key = (rows, width)
        self.last_tried[key] = self.decisions
        switched, self.previous[rows] = self.previous.get(rows) != width, width
        if (rows, width, block) not in self.seen or switched:
            self.seen.add((rows, width, block))
            return
        if tokens and seconds > 0:
            calls = self.calls.setdefault(key, deque(maxlen=WINDOW))
            calls.append((tokens, seconds))
            self.rates[key] = trimmed_rate(calls)

    def yielded(self, rows: int, width: int, tokens: int, row_steps: int):
        """A speculative call's sequences made `tokens` tokens in `row_steps` (its steps times its sequences)."""
        made = self.made.setdefault((rows, width), deque(maxlen=WINDOW))
        made.append((tokens, row_steps))
        self.yields[rows, width] = sum(t for t, _ in made) / max(sum(n for _, n in made), 1)

    def timed(self, rows: int) -> bool:
        """Whether plain calls over `rows` rows have been timed."""
        return (rows, 1) in self.rates

    def choose(self, rows: int) -> int:
        """The width of the next call over `rows` rows: 1 (a plain call) until plain calls have been timed."""
        self.decisions += 1
        if self.always:
            return self.widths[-1]
        judged = [w for w in self.widths if len(self.calls.get((rows, w), ())) >= JUDGED_AFTER]
        if 1 not in judged:
            return 1
        eligible = [w for w in judged if w == 1 or self.yields.get((rows, w), 0) >= MIN_YIELD]
        best = max(eligible, key=lambda w: self.rates[rows, w])
        wider = [w for w in self.widths if w > judged[-1]]
        if wider and best == judged[-1]:  # the widest judged is the best so far: the next wider one may be too
            return wider[0]
        width, left = self.exploring.pop(rows, (0, 0))
        if left:
            self.exploring[rows] = (width, left - 1)
            return width
        if self.decisions % EXPLORE_EVERY == 0:
            width = min(self.widths, key=lambda w: self.last_tried.get((rows, w), -1))
            self.exploring[rows] = (width, EXPLORING_CALLS - 1)
            return width
        return best


def trimmed_rate(calls) -> float:
    """Tokens a second over (tokens, seconds) calls, the slowest share of them (by seconds a token) left out: a call
    the machine stalled (a thread woken late on a busy core can take several times a call's time) says nothing of
    the width. A ratio of sums: calls of different lengths weigh as their tokens do."""
    kept = sorted(calls, key=lambda c: c[1] / c[0])[: max(1, round(len(calls) * (1 - STALLED_SHARE)))]
    return sum(t for t, _ in kept) / sum(s for _, s in kept)
