"""How wide a speculative call's steps are (1: plain decoding), chosen by the tokens a second each width has
delivered on this machine and workload.

How it works and why: docs/INTERNALS.md, moe_jax/generation/speculation.py.
"""

from __future__ import annotations

from moe_jax.errors import InputError

MAX_DRAFTS = 15  # the most drafts a row's step verifies
RATE_WEIGHT = 0.25  # weight of the newest call in a width's running tokens a second
OUTLIER = 10.0  # a call this many times slower than its width's running rate is not counted (a compilation)
EXPLORE_EVERY = 32  # decisions between calls of the width tried longest ago (a workload can start or stop copying)

POLICIES = ("cost", "always")


class DraftPolicy:
    """The width of the next call's steps over some rows ("cost"): the width whose calls have delivered the most
    tokens a second over that many rows, plain calls (width 1) included, each a running mean that follows the
    workload. The next wider width is tried while the widest measured is the best (a wider step costs more, so
    where one width does not beat a narrower one a wider one rarely does); every EXPLORE_EVERY-th decision the
    width tried longest ago runs instead, so one that a change of workload made faster is seen. "always": the
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
        self.rates: dict[tuple[int, int], float] = {}
        self.last_tried: dict[tuple[int, int], int] = {}
        self.seen: set[tuple[int, int, bool]] = set()
        self.decisions = 0

    def observed(self, rows: int, width: int, tokens: int, seconds: float, block: bool = True):
        """A call `width` tokens wide (1: plain) over `rows` rows made `tokens` tokens in `seconds`, the host's
        reading of it in. `block`: the call was a block of steps (a plain call of one step is compiled apart)."""
        key = (rows, width)
        self.last_tried[key] = self.decisions
        if (rows, width, block) not in self.seen:
            self.seen.add((rows, width, block))
            return
        if not tokens or seconds <= 0:
            return
        rate, old = tokens / seconds, self.rates.get(key)
        if old is None:
            self.rates[key] = rate
        elif rate * OUTLIER > old:
            self.rates[key] = (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate

    def choose(self, rows: int) -> int:
        """The width of the next call over `rows` rows: 1 (a plain call) until plain calls have been timed."""
        self.decisions += 1
        if self.always:
            return self.widths[-1]
        if (rows, 1) not in self.rates:
            return 1
        measured = [w for w in self.widths if (rows, w) in self.rates]
        best = max(measured, key=lambda w: self.rates[rows, w])
        wider = [w for w in self.widths if w > measured[-1]]
        if wider and best == measured[-1]:  # the widest measured is the best so far: the next wider one may be too
            return wider[0]
        if self.decisions % EXPLORE_EVERY == 0:
            return min(self.widths, key=lambda w: self.last_tried.get((rows, w), -1))
        return best
