"""Agent conversation traces for the anchor-cache benchmark, and the harness that turns them into prompts.

    python bench/agent_traces.py    # rewrites bench/data/agent_trace.json (deterministic)

A trace is 24 turns of a tool-using agent over token ids: user message, thinking, tool call, tool result (some
long), answer, each closed by its own delimiter token. The harness renders the prompt of every request:
step 1 of a turn (context + user message; the model would think and call a tool) and step 2 (+ this turn's
thinking, tool call and result; the model would answer). Like reasoning models' chat templates it drops
earlier turns' thinking from the context, and in the "trim" scenario it also shortens a long tool result from
three turns back every fourth turn, as harnesses do to save context.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRACE = Path(__file__).resolve().parent / "data" / "agent_trace.json"
SYSTEM_END, USER_END, THINK_START, THINK_END, CALL_END, RESULT_END, ANSWER_END = 1, 2, 3, 4, 5, 6, 7
ANCHORS = (SYSTEM_END, USER_END, THINK_END, CALL_END, RESULT_END, ANSWER_END)
FIRST_CONTENT_TOKEN = 16


def make_trace(seed: int = 0, turns: int = 24, vocab: int = 4096) -> dict:
    rng = random.Random(seed)

    def text(lo, hi):
        return [rng.randrange(FIRST_CONTENT_TOKEN, vocab) for _ in range(rng.randint(lo, hi))]

    return {
        "system": text(48, 64),
        "turns": [
            {
                "user": text(8, 14),
                "thinking": text(24, 48),
                "call": text(5, 8),
                "result": text(64, 96) if i % 3 == 0 else text(12, 32),
                "answer": text(6, 12),
            }
            for i in range(turns)
        ],
    }


def render_turn(turn: dict, result: list[int]) -> list[int]:
    return turn["user"] + [USER_END] + turn["call"] + [CALL_END] + result + [RESULT_END] + turn["answer"] + [ANSWER_END]


def requests(trace: dict, trim: bool) -> list[tuple[str, list[int]]]:
    """(what changed, prompt tokens) for both steps of every turn."""
    system = trace["system"] + [SYSTEM_END]
    results = [t["result"] for t in trace["turns"]]
    out = []
    for i, turn in enumerate(trace["turns"]):
        edit = "appended turn, previous thinking dropped" if i else "first turn"
        if trim and i >= 4 and i % 4 == 0 and len(results[i - 3]) > 16:
            results[i - 3] = results[i - 3][:8]  # the harness keeps the head of a long, old tool result
            edit = "appended turn, previous thinking dropped, old tool result trimmed"
        context = system + [tok for j in range(i) for tok in render_turn(trace["turns"][j], results[j])]
        step1 = context + turn["user"] + [USER_END]
        step2 = step1 + [THINK_START] + turn["thinking"] + [THINK_END] + turn["call"] + [CALL_END] + turn["result"]
        step2 += [RESULT_END]
        out += [(edit, step1), ("thinking, tool call and result appended", step2)]
    return out


if __name__ == "__main__":
    TRACE.parent.mkdir(exist_ok=True)
    TRACE.write_text(json.dumps(make_trace()))
    print(f"wrote {TRACE}")
