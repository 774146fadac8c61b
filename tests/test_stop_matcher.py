"""The stop-string automaton against the obvious scan: same first match, same held-back length, fed in any pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.serving.stop_matcher import StopMatcher
from moe_jax.serving.text_stream import partial_prefix_length

ALPHABET = "abc"  # few letters: stops overlap and share beginnings often
stops_st = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=6)


def first_stop_by_scan(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(end, length) of the stop that ends first in `text`, the longest of those ending there."""
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending)
    return None


@settings(max_examples=300, deadline=None)
@given(stops=stops_st, text=st.text(ALPHABET, max_size=30), cuts=st.lists(st.integers(0, 30), max_size=6))
def test_matches_the_scan_fed_in_any_pieces(stops, text, cuts):
    matcher = StopMatcher(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    found = None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        hit = matcher.feed(text[lo:hi])
        if hit is not None:
            found = (lo + hit[0], hit[1])
            break
        assert matcher.pending == partial_prefix_length(text[:hi], stops)
    assert found == first_stop_by_scan(text, stops)


def test_ten_thousand_stops_in_one_automaton():
    stops = [f"stop number {i}!" for i in range(10_000)]
    matcher = StopMatcher(stops)
    assert matcher.feed("a text that says stop number 12") is None
    assert matcher.pending == len("stop number 12")  # still the start of "stop number 12!" (and 120!, ...)
    assert matcher.feed("3!") == (2, len("stop number 123!"))


def test_empty_stops_are_ignored():
    matcher = StopMatcher(["", "x"])
    assert matcher.feed("abc") is None and matcher.pending == 0
    assert matcher.feed("ax") == (2, 1)
