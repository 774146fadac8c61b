"""The synthetic string tasks behind the bundled default model and its fine-tuning task.

A line is `<task> <word> > <answer>`: the base model is pretrained on `copy` and `sort` (it learns to point at
input characters and to write an answer), and the bundled fine-tuning task is `reverse`, which it has never seen.
Everything is generated from a seed, so the bundled files can be remade exactly.
"""

from __future__ import annotations

import random
import string

LETTERS = string.ascii_lowercase
BASE_TASKS = ("copy", "sort")
FINETUNE_TASK = "reverse"


def answer(task: str, word: str) -> str:
    if task == "copy":
        return word
    if task == "sort":
        return "".join(sorted(word))
    if task == "reverse":
        return word[::-1]
    raise ValueError(f"unknown task {task!r}")


def prompt(task: str, word: str) -> str:
    return f"{task} {word} >"


def random_word(rng: random.Random, min_len: int = 3, max_len: int = 6) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


def examples(task: str, count: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """`count` distinct (prompt, answer) pairs whose words are not in `exclude`."""
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < count:
        word = random_word(rng)
        if word in seen:
            continue
        seen.add(word)
        out.append((prompt(task, word), " " + answer(task, word)))
    return out


def tool_task(rng: random.Random) -> tuple[dict, str, dict]:
    """One made-up tool (name and parameter), a user message of a few words, and the call the bundled model learned
    to make for it: the tool with the message's last word as the argument. (tool, message, call), as chat
    templates take tools and tool calls."""
    name, param = f"{random_word(rng, 3, 8)}_{random_word(rng, 3, 8)}", random_word(rng, 3, 6)
    words = [random_word(rng, 2, 6) for _ in range(rng.randint(1, 3))]
    parameters = {"type": "object", "properties": {param: {"type": "string"}}}
    tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
    call = {"type": "function", "function": {"name": name, "arguments": {param: words[-1]}}}
    return tool, " ".join(words), call
