"""Agent conversation traces for the anchor-cache benchmark, and the harness that turns them into prompts.

    python bench/agent_traces.py    # rewrites bench/data/agent_trace.json (deterministic)

A trace is 24 turns of a tool-using agent over token ids: user message, thinking, tool call, tool result (some
long), answer, each closed by its own delimiter token. The harness renders the prompt of every request (as token
ids, `requests`, or as the chat messages a harness would send a server, `chat_requests`):
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


def conversation(trace: dict, trim: bool) -> list[tuple[str, list[dict], dict, bool]]:
    """(what changed, earlier turns as the harness resends them, this turn, whether this step carries this turn's
    thinking, tool call and result) for both steps of every turn. Earlier turns keep no thinking; with `trim`,
    a long tool result three turns back is cut to its head every fourth turn."""
    results = [t["result"] for t in trace["turns"]]
    out = []
    for i, turn in enumerate(trace["turns"]):
        edit = "appended turn, previous thinking dropped" if i else "first turn"
        if trim and i >= 4 and i % 4 == 0 and len(results[i - 3]) > 16:
            results[i - 3] = results[i - 3][:8]  # the harness keeps the head of a long, old tool result
            edit = "appended turn, previous thinking dropped, old tool result trimmed"
        earlier = [{**trace["turns"][j], "result": results[j]} for j in range(i)]
        out += [(edit, earlier, turn, False), ("thinking, tool call and result appended", earlier, turn, True)]
    return out


def requests(trace: dict, trim: bool) -> list[tuple[str, list[int]]]:
    """(what changed, prompt tokens) for both steps of every turn."""
    out = []
    for edit, earlier, turn, acted in conversation(trace, trim):
        prompt = trace["system"] + [SYSTEM_END]
        for t in earlier:
            prompt += t["user"] + [USER_END] + t["call"] + [CALL_END] + t["result"] + [RESULT_END]
            prompt += t["answer"] + [ANSWER_END]
        prompt += turn["user"] + [USER_END]
        if acted:
            prompt += [THINK_START] + turn["thinking"] + [THINK_END] + turn["call"] + [CALL_END] + turn["result"]
            prompt += [RESULT_END]
        out.append((edit, prompt))
    return out


def chat_requests(trace: dict, trim: bool) -> list[tuple[str, list[dict]]]:
    """The same requests as chat messages (what an agent harness sends a server): rendered with
    CHAT_TEMPLATE by the tokenizer `write_chat_tokenizer` writes, they are `requests(trace, trim)`'s tokens."""

    def words(tokens):
        return " ".join(f"w{t}" for t in tokens)

    def call(tokens):
        return [{"type": "function", "function": {"name": "tool", "arguments": {"words": words(tokens)}}}]

    out = []
    for edit, earlier, turn, acted in conversation(trace, trim):
        messages = [{"role": "system", "content": words(trace["system"])}]
        for t in earlier:
            messages += [
                {"role": "user", "content": words(t["user"])},
                {"role": "assistant", "content": "", "tool_calls": call(t["call"])},
                {"role": "tool", "content": words(t["result"])},
                {"role": "assistant", "content": words(t["answer"])},
            ]
        messages.append({"role": "user", "content": words(turn["user"])})
        if acted:
            messages += [
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": words(turn["thinking"]),
                    "tool_calls": call(turn["call"]),
                },
                {"role": "tool", "content": words(turn["result"])},
            ]
        out.append((edit, messages))
    return out


SPECIAL = {
    "<pad>": 0,
    "<|system_end|>": SYSTEM_END,
    "<|user_end|>": USER_END,
    "<think>": THINK_START,
    "</think>": THINK_END,
    "<|call_end|>": CALL_END,
    "<|result_end|>": RESULT_END,
    "<|answer_end|>": ANSWER_END,
}
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ m.content }}<|system_end|>"
    "{%- elif m.role == 'user' -%}{{ m.content }}<|user_end|>"
    "{%- elif m.role == 'tool' -%}{{ m.content }}<|result_end|>"
    "{%- else -%}"
    "{%- if m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{{ c.function.arguments.words }}<|call_end|>{%- endfor -%}"
    "{%- if m.content -%}{{ m.content }}<|answer_end|>{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def write_chat_tokenizer(directory: Path, vocab: int = 4096):
    """tokenizer.json and tokenizer_config.json for the trace's token ids: ids below FIRST_CONTENT_TOKEN are
    special tokens (the delimiters above), the others the words `w<id>`, with CHAT_TEMPLATE."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {name: i for name, i in SPECIAL.items()}
    words.update({f"<|unused{i}|>": i for i in range(FIRST_CONTENT_TOKEN) if i not in SPECIAL.values()})
    words.update({f"w{i}": i for i in range(FIRST_CONTENT_TOKEN, vocab)})
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in sorted(SPECIAL, key=SPECIAL.get)])
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"chat_template": CHAT_TEMPLATE, "eos_token": "<pad>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


if __name__ == "__main__":
    TRACE.parent.mkdir(exist_ok=True)
    TRACE.write_text(json.dumps(make_trace()))
    print(f"wrote {TRACE}")
