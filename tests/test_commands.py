"""`moe-jax COMMAND`: the one entry point (as `python -m moe_jax`, what the console script runs), each command's
--help under its name, `infer -p`, and `chat` with its answers checked against generating offline."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moe_jax
from moe_jax import bundled
from moe_jax.__main__ import COMMANDS
from moe_jax.formats.prompts import render_chat

ROOT = Path(__file__).resolve().parents[1]


def moe_jax_command(*args, stdin: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_jax", *map(str, args)], capture_output=True, text=True, input=stdin, cwd=cwd
    )


@pytest.fixture(scope="module")
def offline():
    return moe_jax.load_model(bundled.MODEL)


def test_the_entry_point_lists_its_commands_and_refuses_unknown_ones():
    listed = moe_jax_command("--help")
    assert listed.returncode == 0 and all(name in listed.stdout for name in COMMANDS)
    bare = moe_jax_command()
    assert bare.returncode == 2 and "usage: moe-jax COMMAND" in bare.stderr
    typo = moe_jax_command("trian")
    assert typo.returncode == 2 and "no command 'trian'; did you mean 'train'?" in typo.stderr
    assert moe_jax_command("--version").stdout.startswith("moe-jax ")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help_under_its_name(name):
    result = moe_jax_command(name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: moe-jax {name}"), result.stdout[:200]


def test_the_checkout_scripts_keep_their_names():
    result = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.startswith("usage: python train.py")


def test_infer_prompts_from_the_command_line_equal_a_prompts_file(tmp_path, offline):
    texts = ["copy srel >", "sort dcba >"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    flags = ["--max-new-tokens", 8, "--model", bundled.MODEL]
    by_flag = moe_jax_command("infer", *flags, "-p", texts[0], "-p", texts[1], "--out", tmp_path / "a.jsonl")
    by_file = moe_jax_command("infer", *flags, "--prompts", prompts, "--out", tmp_path / "b.jsonl")
    assert by_flag.returncode == by_file.returncode == 0, by_flag.stderr + by_file.stderr
    records = [[json.loads(line) for line in (tmp_path / f).read_text().splitlines()] for f in ("a.jsonl", "b.jsonl")]
    assert [r["completion"] for r in records[0]] == [r["completion"] for r in records[1]]
    assert [r["completion"] for r in records[0]] == offline.generate(texts, max_new_tokens=8)  # strings in, out


def test_chat_streams_each_turn_in_the_template_and_reset_starts_over(tmp_path, offline):
    """Greedy chat over stdin: each answer is what generating from the rendered conversation gives; after
    /reset the same message gets the same answer as the first turn (nothing of the old conversation is kept)."""
    first, second = "copy srel >", "sort dcba >"
    result = moe_jax_command(
        "chat", "--temperature", 0, "--max-new-tokens", 12, stdin=f"{first}\n{second}\n/reset\n{first}\n", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    answers = result.stdout.splitlines()
    tokenizer = offline.tokenizer

    def reply(messages):
        ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
        return tokenizer.decode(offline.generate([ids], max_new_tokens=12)[0])

    one = reply([{"role": "user", "content": first}])
    two = reply(
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": one},
            {"role": "user", "content": second},
        ]
    )
    assert answers == [one, two, one]
    assert "(conversation reset)" in result.stderr


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_says_what_it_does(name, monkeypatch):
    import argparse
    import importlib

    from moe_jax.train.config import SETTINGS_HELP, TrainConfig

    def capture(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as parsed:
        importlib.import_module(COMMANDS[name][0]).main([])
    silent = [a.option_strings[-1] for a in parsed.value.parser._actions if a.option_strings and not a.help]
    assert silent == [], f"moe-jax {name}: options without help: {silent}"
    assert set(SETTINGS_HELP) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_chat_with_a_model_without_a_template_says_what_to_use(tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(bundled.MODEL, model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    result = moe_jax_command("chat", "--model", model, stdin="hello\n")
    assert result.returncode == 2
    assert f"{model}: the checkpoint has no chat template; use `moe-jax infer -p TEXT` instead" in result.stderr
