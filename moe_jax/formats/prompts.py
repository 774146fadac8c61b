"""Reading prompt and data files: JSONL with line-numbered errors, chat rendering with the checkpoint's template."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_jax.errors import InputError, is_int
from moe_jax.formats.chat_template import render_template


def read_jsonl(path, on_bad_line: Callable[[str], None] | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-empty line. A malformed line raises naming file and line, or, when
    `on_bad_line` is given, is passed to it as that message and skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: unreadable ({e})") from e
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise InputError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        except json.JSONDecodeError as e:
            problem = InputError(f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno})")
            if on_bad_line is None:
                raise problem from None
            on_bad_line(str(problem))
            continue
        except InputError as problem:
            if on_bad_line is None:
                raise
            on_bad_line(str(problem))
            continue
        yield number, record


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, where: str = "", **template_kwargs
) -> str:
    """Messages rendered with the checkpoint's chat template (in jinja2's sandbox, as transformers does);
    `template_kwargs` (`tools`, `enable_thinking`, ...) are passed to the template as transformers passes them."""
    if tokenizer is None or not tokenizer.chat_template:
        raise InputError(f"{where}messages given, but the checkpoint has no chat template")
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InputError(f"{where}message {i} needs a string 'role' and a 'content'")
        if not isinstance(m["content"], str | list):
            raise InputError(f"{where}message {i}: 'content' must be a string or a list of parts")
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(template_kwargs)
    if reserved:
        raise InputError(f"{where}template arguments may not set {', '.join(sorted(reserved))}")
    return render_template(
        tokenizer.chat_template,
        where,
        **template_kwargs,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
    )


def prompt_token_ids(record: dict, tokenizer, where: str) -> tuple[list[int], str | None]:
    """Token ids (and the text, when there is one) of one prompt record: prompt, messages or input_ids."""
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise InputError(f"{where}'input_ids' must be a list of integers")
        return ids, None
    if "messages" in record:
        text = render_chat(tokenizer, record["messages"], where=where)
        return tokenizer.encode(text, add_special_tokens=False), text
    if "prompt" in record:
        if tokenizer is None:
            raise InputError(f"{where}text prompt given, but the checkpoint has no tokenizer.json")
        if not isinstance(record["prompt"], str):
            raise InputError(f"{where}'prompt' must be a string")
        return tokenizer.encode(record["prompt"]), record["prompt"]
    raise InputError(f"{where}expected one of 'prompt', 'messages' or 'input_ids'")
