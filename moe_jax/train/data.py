"""Fine-tuning data: JSONL in plain-text, instruction and chat formats, tokenised with per-token loss masks.

How it works and why: docs/INTERNALS.md, moe_jax/train/data.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_jax.errors import InputError
from moe_jax.formats.prompts import read_jsonl, render_chat


@dataclass
class Example:
    ids: list[int]
    mask: list[int]
    prompt_text: str | None = None  # instruction/chat examples: what a generation is prompted with
    answer_text: str | None = None  # ... and the expected answer, for exact-match evaluation


@dataclass
class DataStats:
    examples: int = 0
    skipped_lines: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    skipped_where: list[str] = field(default_factory=list)


def load_examples(
    path,
    tokenizer,
    max_seq_len: int,
    long_examples: str = "truncate",
    skip_bad_lines: bool = False,
    stats: DataStats | None = None,
) -> list[Example]:
    if tokenizer is None:
        raise InputError("fine-tuning needs a tokenizer, and the checkpoint has no tokenizer.json")
    stats = stats if stats is not None else DataStats()
    examples = []

    def skip(message: str):
        stats.skipped_lines += 1
        stats.skipped_where.append(message)

    for number, record in read_jsonl(path, on_bad_line=skip if skip_bad_lines else None):
        where = f"{path}:{number}: "
        try:
            example = encode_record(record, tokenizer, where)
        except InputError as e:
            if not skip_bad_lines:
                raise
            skip(str(e))
            continue
        if len(example.ids) > max_seq_len:
            if long_examples == "drop":
                stats.dropped_too_long += 1
                continue
            stats.truncated += 1
            example.ids, example.mask = example.ids[:max_seq_len], example.mask[:max_seq_len]
        if sum(example.mask[1:]) == 0:
            stats.dropped_no_target += 1
            continue
        examples.append(example)
    stats.examples = len(examples)
    if not examples:
        raise InputError(f"{path}: no usable examples (empty file, or every example was dropped)")
    return examples


def encode_record(record: dict, tok, where: str) -> Example:
    eos = tok.token_to_id(tok.eos_token) if tok.eos_token else None
    eos_ids = [eos] if eos is not None else []
    if "messages" in record:
        return _encode_chat(record["messages"], tok, where)
    if "instruction" in record or "output" in record:
        if not isinstance(record.get("instruction"), str) or not isinstance(record.get("output"), str):
            raise InputError(f"{where}instruction examples need string 'instruction' and 'output'")
        prompt = record["instruction"] + (f"\n{record['input']}" if record.get("input") else "")
        prompt_ids = tok.encode(prompt)
        answer_ids = tok.encode(record["output"], add_special_tokens=False) + eos_ids
        return Example(prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids), prompt, record["output"])
    if "text" in record:
        if not isinstance(record["text"], str):
            raise InputError(f"{where}'text' must be a string")
        ids = tok.encode(record["text"]) + eos_ids
        return Example(ids, [0] + [1] * (len(ids) - 1))  # the first token is never predicted
    raise InputError(f"{where}expected 'text', 'instruction'/'output' or 'messages'")


def _encode_chat(messages, tok, where: str) -> Example:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}'messages' must be a non-empty list")
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, message in enumerate(messages):
        is_assistant = isinstance(message, dict) and message.get("role") == "assistant"
        if is_assistant:  # the generation prompt belongs to the context, not to the target
            with_prompt = render_chat(tok, messages[:i], add_generation_prompt=True, where=where)
            rendered = _append(tok, rendered, with_prompt, ids, mask, 0, where)
        text = render_chat(tok, messages[: i + 1], add_generation_prompt=False, where=where)
        rendered = _append(tok, rendered, text, ids, mask, int(is_assistant), where)
    if tok.add_bos and tok.bos_token and not rendered.startswith(tok.bos_token):
        bos = tok.token_to_id(tok.bos_token)
        ids, mask = [bos, *ids], [0, *mask]
    return Example(ids, mask)


def _append(tok, rendered: str, text: str, ids: list, mask: list, target: int, where: str) -> str:
    if not text.startswith(rendered):
        raise InputError(f"{where}the chat template does not render conversations prefix by prefix")
    piece = tok.encode(text[len(rendered) :], add_special_tokens=False)
    ids.extend(piece)
    mask.extend([target] * len(piece))
    return text


def pack(examples: list[Example], max_seq_len: int) -> list[Example]:
    """Greedy sequence packing: examples concatenated into rows of at most max_seq_len tokens.

    Tokens of one example can attend to earlier examples of the same row (no block-diagonal mask); targets stay
    exactly those of each example.
    """
    rows, ids, mask = [], [], []
    for ex in examples:
        if ids and len(ids) + len(ex.ids) > max_seq_len:
            rows.append(Example(ids, mask))
            ids, mask = [], []
        ids, mask = ids + ex.ids, mask + ex.mask
    if ids:
        rows.append(Example(ids, mask))
    return rows


class Batches:
    """Deterministic batches: step s of a run always gets the same examples, in every process."""

    def __init__(self, examples: list[Example], batch_size: int, max_seq_len: int, pad_id: int, seed: int):
        self.examples, self.batch_size, self.max_seq_len = examples, batch_size, max_seq_len
        self.pad_id, self.seed = pad_id, seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))}
        return self._orders[epoch]

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [b, max_seq_len] int32, mask [b, max_seq_len] int32) of the index-th batch of the run."""
        tokens = np.full((self.batch_size, self.max_seq_len), self.pad_id, np.int32)
        mask = np.zeros((self.batch_size, self.max_seq_len), np.int32)
        n = len(self.examples)
        for row in range(self.batch_size):
            position = index * self.batch_size + row
            ex = self.examples[self._order(position // n)[position % n]]
            tokens[row, : len(ex.ids)] = ex.ids
            mask[row, : len(ex.mask)] = ex.mask
        return tokens, mask


def split_held_out(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    order = np.random.default_rng([seed, 7919]).permutation(len(examples))
    cut = max(1, int(round(len(examples) * fraction)))
    held = set(order[:cut].tolist())
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]
