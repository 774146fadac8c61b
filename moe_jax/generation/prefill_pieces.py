"""How a prompt goes through prefill steps: the tokens it still needs (after any prefix from the anchor cache) cut
into pieces of at most a step's width, one piece a step, and also cut at each anchor whose state is to be saved for
a model with recurrent layers (Qwen3-Next's DeltaNet): its state exists only as of the end of a step, so a step must
end there. Rows of a step each take their own next piece; a row with none left pads the step."""

from __future__ import annotations


def piece_ends(length: int, width: int, stops=()) -> list[int]:
    """Where each piece of a `length`-token suffix ends (the last: `length`): every `width` tokens, counted again from
    each stop in `stops` (positions within the suffix, 0 < stop < length) at which a piece must end."""
    ends, start = [], 0
    cuts = sorted(s for s in set(stops) if 0 < s < length)
    while start < length:
        end = min(start + width, length, *(s for s in cuts if s > start))
        ends.append(end)
        start = end
    return ends


def piece(ends: list[int], step: int) -> tuple[int, int]:
    """[start, end) of a row's piece at `step` ((end, end): none left, the row only pads the step)."""
    if step >= len(ends):
        return ends[-1], ends[-1]
    return (ends[step - 1] if step else 0), ends[step]
