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
YIELD_STEPS = 64  # sequences' steps, the latest, whose accepted drafts make a width's yield (counted, not timed)
YIELD_CALLS = 4  # ... and at least this many calls' (a few of a big batch's calls hold many sequences' steps)
EXPLORE_EVERY = 128  # decisions between calls of the width tried longest ago (a workload can start or stop copying)
EXPLORING_CALLS = 4  # calls in a row an exploration runs (the first, after a switch, is not counted)

POLICIES = ("cost", "always")


class DraftPolicy:
    """The width of the next call's steps over some rows ("cost"): the width whose calls would deliver the most
    tokens a second (`rate`: their steps a second, timed over their last calls once JUDGED_AFTER have run, times
    the tokens a sequence's step makes at that width, counted from the drafts recent calls accepted), among the
    widths whose steps make at least MIN_YIELD tokens (one call as wide as it gets tells that of every width).
    Splitting the rate so, a change of workload moves what is counted at once and leaves what is timed (slow to
    learn on a noisy machine) as it was. The next wider width is tried while the widest judged is the best; every
    EXPLORE_EVERY-th decision the width tried longest ago runs for EXPLORING_CALLS calls, or, where no width's steps
    make enough, one call as wide as it gets. "always": the widest step at every call, whatever it costs (to
    measure acceptance, and for tests)."""

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
        self.calls: dict[tuple[int, int], deque[tuple[float, int]]] = {}  # (seconds a step, steps) of the latest
        self.step_rates: dict[tuple[int, int], float] = {}  # steps a second: trimmed_rate of those
        # tokens a sequence's step makes at each speculative width, from the accepted drafts of recent speculative
        # calls as wide or wider: counted, not timed, so free of the machine's noise; a width below MIN_YIELD
        # cannot pay for its wider steps and is not chosen
        self.made: dict[int, deque[tuple[int, int]]] = {}  # by width: (tokens, sequences' steps) of the latest calls
        self.yields: dict[int, float] = {}
        self.last_tried: dict[tuple[int, int], int] = {}
        self.seen: set[tuple[int, int, bool]] = set()
        # the width of the last call by rows: a call of another width than the one before it runs on caches that
        # held the other step's code and data, slower than that width's calls in a row, and is left out
        self.previous: dict[int, int] = {}
        self.exploring: dict[int, tuple[int, int]] = {}  # rows -> (width explored, calls of it still to run)
        self.decisions = 0

    def observed(self, rows: int, width: int, steps: int, seconds: float, block: bool = True):
        """A call of `steps` steps `width` tokens wide (1: plain) over `rows` rows took `seconds`, the host's
        reading of it in. `block`: the call was a block of steps (a plain call of one step is compiled apart)."""
        key = (rows, width)
        self.last_tried[key] = self.decisions
        switched, self.previous[rows] = self.previous.get(rows) != width, width
        if (rows, width, block) not in self.seen or switched:
            self.seen.add((rows, width, block))
            return
        if steps and seconds > 0:
            calls = self.calls.setdefault(key, deque(maxlen=WINDOW))
            calls.append((seconds / steps, steps))
            self.step_rates[key] = trimmed_rate(calls)

    def accepted(self, rows: int, counts):
        """A speculative call's sequences' steps by how many drafts they accepted (`counts` [width]: 0 to width - 1),
        which tells what every narrower width would have made too."""
        steps = int(sum(counts))
        for width in self.widths[1:]:
            if width <= len(counts) and steps:
                made = sum(int(n) * (1 + min(k, width - 1)) for k, n in enumerate(counts))
                kept = self.made.setdefault(width, deque())
                kept.append((made, steps))
                while len(kept) > YIELD_CALLS and sum(n for _, n in kept) - kept[0][1] >= YIELD_STEPS:
                    kept.popleft()
                self.yields[width] = sum(m for m, _ in kept) / sum(n for _, n in kept)

    def timed(self, rows: int) -> bool:
        """Whether plain calls over `rows` rows have been timed."""
        return (rows, 1) in self.step_rates

    def rate(self, rows: int, width: int) -> float:
        """The tokens a second a sequence can expect of calls this wide over `rows` rows: their steps a second
        (timed, a property of this model and machine) times the tokens its steps make (counted, the workload's
        now)."""
        return self.step_rates[rows, width] * (1 if width == 1 else self.yields[width])

    def choose(self, rows: int) -> int:
        """The width of the next call over `rows` rows: 1 (a plain call) until plain calls have been timed."""
        self.decisions += 1
        widest = self.widths[-1]
        if self.always:
            return widest
        if len(self.calls.get((rows, 1), ())) < JUDGED_AFTER:
            return 1
        if widest not in self.yields:  # one call as wide as it gets tells what every width's steps make
            return widest
        width, left = self.exploring.pop(rows, (0, 0))
        if left:
            self.exploring[rows] = (width, left - 1)
            return width
        eligible = [w for w in self.widths if w == 1 or self.yields[w] >= MIN_YIELD]
        judged = [w for w in eligible if len(self.calls.get((rows, w), ())) >= JUDGED_AFTER]
        best = max(judged, key=lambda w: self.rate(rows, w))
        wider = [w for w in eligible if w > best and w not in judged]
        if wider and best == judged[-1]:  # the widest judged is the best so far: the next wider one may be too
            return wider[0]
        if self.decisions % EXPLORE_EVERY:
            return best
        others = [w for w in eligible if w != best]
        if not others:  # no width's steps make enough: one wide call to see whether they have started to
            return widest
        width = min(others, key=lambda w: self.last_tried.get((rows, w), -1))
        self.exploring[rows] = (width, EXPLORING_CALLS - 1)
        return width


def trimmed_rate(calls) -> float:
    """Steps a second over (seconds a step, steps) calls, the slowest share of them left out: a call the machine
    stalled (a thread woken late on a busy core can take several times a call's time) says nothing of the width. A
    ratio of sums: calls of different lengths weigh as their steps do."""
    kept = sorted(calls)[: max(1, round(len(calls) * (1 - STALLED_SHARE)))]
    return sum(n for _, n in kept) / sum(per * n for per, n in kept)
