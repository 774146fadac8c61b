"""How many drafted tokens a speculative step verifies, chosen by what it costs on this machine.

A verify step scores each row's last token and its drafts at once (`GenerationSteps.verify`): one pass over the
weights for all of them, but every extra token a row carries may route to experts no other token uses, so a wider
step takes longer. Whether that pays depends on how often drafts are accepted, which depends on the request (an
agent quoting its context accepts most; free text almost none). `DraftPolicy` keeps the measured seconds of a step
at each width (1: a plain decode step) and each sequence's running acceptance rate, and picks the width whose
expected tokens per second is highest, 1 (no speculation) where none beats a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_jax.errors import InputError

MAX_DRAFTS = 15  # the most drafts a row's step verifies
TIME_WEIGHT = 0.2  # weight of the newest measurement in a width's running step time
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0  # a new sequence's acceptance rate starts at 1/2, worth two drafts


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


class DraftPolicy:
    """The width of the next step from measured step times and the rows' acceptance ("cost"). Widths not measured
    yet are tried where their guessed cost (the plain step's time) would pay; a width then keeps a running mean of
    its measured seconds. "always": the narrowest width that holds every row's drafts, whatever it costs (to
    measure acceptance, and for tests)."""

    def __init__(self, max_drafts: int, policy: str = "cost"):
        if not 1 <= max_drafts <= MAX_DRAFTS:
            raise InputError(f"drafts {max_drafts}: from 1 to {MAX_DRAFTS}")
        if policy not in POLICIES:
            raise InputError(f"draft policy {policy!r}: one of {', '.join(POLICIES)}")
        # tokens a row in a step: 1 (a plain step), then powers of two and the widest (each width compiles once)
        self.widths = tuple(sorted({1 << i for i in range(5) if 1 << i <= max_drafts} | {max_drafts + 1}))
        self.always = policy == "always"
        self.seconds: dict[int, float] = {}

    def measured(self, width: int, seconds: float):
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else (1 - TIME_WEIGHT) * old + TIME_WEIGHT * seconds

    def choose(self, rows: list[tuple[Acceptance, int]]) -> int:
        """The width for rows given as (acceptance, drafts available): 1 until a plain step has been timed."""
        if self.always:
            longest = max((n for _, n in rows), default=0)
            return 1 if not longest else next((w for w in self.widths if w > longest), self.widths[-1])
        plain = self.seconds.get(1)
        if plain is None:
            return 1
        best, best_rate = 1, len(rows) / plain
        for width in self.widths[1:]:
            tokens = sum(a.expected_tokens(min(width - 1, n)) for a, n in rows)
            rate = tokens / self.seconds.get(width, plain)
            if rate > best_rate:
                best, best_rate = width, rate
        return best
