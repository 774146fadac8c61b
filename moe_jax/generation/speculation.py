"""How many drafted tokens a speculative step verifies, chosen by what it costs on this machine.

How it works and why: docs/INTERNALS.md, moe_jax/generation/speculation.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_jax.errors import InputError

MAX_DRAFTS = 15  # the most drafts a row's step verifies
TIME_WEIGHT = 0.2  # weight of the newest measurement in a running step time
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0  # a first sequence's acceptance rate starts at 1/2, worth two drafts
OUTLIER = 10.0  # a verify step this many times slower than its estimate is not counted (a compilation)
PLAIN_DRIFT = 0.01  # the fastest plain step's time rises this share with every plain call (to follow a slowdown)
EXPLORE_EVERY = 128  # decisions between verify steps taken whatever the cost (a workload can start copying)


@dataclass
class Acceptance:
    """One sequence's drafts so far: how many were verified and how many of those accepted."""

    accepted: float = PRIOR_ACCEPTED
    drafted: float = PRIOR_DRAFTED

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted

    def add(self, accepted: int, drafted: int):
        self.accepted += accepted
        self.drafted += drafted

    def expected_tokens(self, drafts: int) -> float:
        """Tokens a step yields with `drafts` drafts, each accepted with the running rate as long as all before it
        were: 1 + r + ... + r^drafts (the step's own token always comes)."""
        r = min(self.rate, 0.999)
        return (1 - r ** (drafts + 1)) / (1 - r)


POLICIES = ("cost", "always")


class PlainCalls:
    """The seconds a plain decode step can take over some rows: the fastest a step of the recent plain calls ran
    (a long pipelined block shares a call's fixed cost among its steps and hides the host's work behind the device's;
    the short calls around verify steps do neither), let drift up slowly so a machine that slows down is followed.
    Against plain decoding at its best, drafting is chosen only where it wins by its own measure."""

    def __init__(self):
        self.best: float | None = None

    def add(self, steps: int, seconds: float):
        per_step = seconds / steps
        self.best = per_step if self.best is None else min(self.best * (1 + PLAIN_DRIFT), per_step)

    def seconds(self, steps: int) -> float:
        return self.best * steps


class DraftPolicy:
    """The width of the next step from measured step times and the rows' acceptance ("cost"): a verify step's
    expected tokens a second against plain calls' (`PlainCalls`). Widths not measured yet are tried where their
    guessed cost (a plain step's) would pay; a width then keeps a running mean of its measured seconds. A new
    sequence starts from the acceptance of those before it, and every EXPLORE_EVERY-th decision verifies one draft
    a row whatever the cost, so a workload that never copies stops drafting and one that starts to is seen.
    "always": the narrowest width that holds every row's drafts, whatever it costs (to measure acceptance, and for
    tests)."""

    def __init__(self, max_drafts: int, policy: str = "cost"):
        if not 1 <= max_drafts <= MAX_DRAFTS:
            raise InputError(f"drafts {max_drafts}: from 1 to {MAX_DRAFTS}")
        if policy not in POLICIES:
            raise InputError(f"draft policy {policy!r}: one of {', '.join(POLICIES)}")
        # tokens a row in a step: 1 (a plain step), then powers of two and the widest (each width compiles once)
        self.widths = tuple(sorted({1 << i for i in range(5) if 1 << i <= max_drafts} | {max_drafts + 1}))
        self.always = policy == "always"
        # costs by the step's rows (each row count is its own compiled step, and costs its own): plain calls',
        # verify steps' by (rows, width); the first call of each compiled step is left out (it compiles), as is a
        # call far slower than its kind's estimate (a compilation the policy did not see coming)
        self.plain: dict[int, PlainCalls] = {}
        self.seconds: dict[tuple[int, int], float] = {}
        self.seen: set[tuple[int, int]] = set()
        self.overall = Acceptance()  # every sequence's drafts
        self.decisions = 0
        self.exploring = False  # this decision verifies whatever the cost

    def new_sequence(self) -> Acceptance:
        """A new sequence's acceptance: the rate so far, worth two drafts."""
        return Acceptance(PRIOR_DRAFTED * self.overall.rate, PRIOR_DRAFTED)

    def record(self, acceptance: Acceptance, accepted: int, drafted: int):
        acceptance.add(accepted, drafted)
        self.overall.add(accepted, drafted)

    def _first(self, key: tuple[int, int]) -> bool:
        first = key not in self.seen
        self.seen.add(key)
        return first

    def timed(self, rows: int) -> bool:
        """Whether plain calls over `rows` rows have been timed."""
        return rows in self.plain

    def plain_call(self, rows: int, steps: int, seconds: float):
        """A plain call of `steps` steps over `rows` rows took `seconds`."""
        if self._first((rows, -1 if steps == 1 else 0)):  # one step and a block are different compiled steps
            return
        self.plain.setdefault(rows, PlainCalls()).add(steps, seconds)

    def measured(self, rows: int, width: int, seconds: float):
        """A verify step `width` tokens wide over `rows` rows took `seconds`, its drafting and bookkeeping in."""
        if self._first((rows, width)):
            return
        old = self.seconds.get((rows, width))
        if old is None:
            self.seconds[rows, width] = seconds
        elif seconds < OUTLIER * old:
            self.seconds[rows, width] = (1 - TIME_WEIGHT) * old + TIME_WEIGHT * seconds

    def worth_a_look(self, acceptances: list[Acceptance], plain_steps: int, rows: int) -> bool:
        """Whether drafts could pay for these sequences (at their running rates and the most drafts a step takes),
        or it is time to explore: only then does the batch wait for its step in flight to draft."""
        self.decisions += 1
        self.exploring = self.decisions % EXPLORE_EVERY == 0
        if self.always or self.exploring or not self.timed(rows):
            return True
        return self.choose([(a, self.widths[-1] - 1) for a in acceptances], plain_steps, rows) > 1

    def choose(self, candidates: list[tuple[Acceptance, int]], plain_steps: int, rows: int) -> int:
        """The width for sequences given as (acceptance, drafts available) in a step of `rows` rows, where a plain
        call instead would run `plain_steps` steps: 1 (that plain call) until plain calls have been timed. An
        unmeasured width is guessed at a plain step's cost."""
        if self.exploring:  # the narrowest verify step: one draft a row tells the rate
            return 2 if any(n for _, n in candidates) else 1
        if self.always:
            longest = max((n for _, n in candidates), default=0)
            return 1 if not longest else next((w for w in self.widths if w > longest), self.widths[-1])
        plain = self.plain.get(rows)
        if plain is None:
            return 1
        best, best_rate = 1, len(candidates) * plain_steps / plain.seconds(plain_steps)
        for width in self.widths[1:]:
            tokens = sum(a.expected_tokens(min(width - 1, n)) for a, n in candidates)
            rate = tokens / self.seconds.get((rows, width), plain.seconds(1))
            if rate > best_rate:
                best, best_rate = width, rate
        return best
