"""README.md as a reader follows it: every command and code block runs (bash blocks in a fresh directory, in order;
Python blocks as scripts), the server examples against `moe-jax serve` on the bundled model through the official
openai and anthropic SDKs, and what they print is checked against generating offline."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import moe_jax
from moe_jax import bundled
from moe_jax.formats.prompts import render_chat

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.S | re.M)
BASH = [code for lang, code in BLOCKS if lang == "bash"]
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
INSTALL = "pip install -e . && "


@pytest.fixture(scope="module")
def offline():
    return moe_jax.load_model(bundled.MODEL)


def chat_answer(model, text: str, tokens: int) -> tuple[str, str]:
    """The greedy chat answer to `text` and why it ended, in Anthropic's words."""
    ids = model.tokenizer.encode(render_chat(model.tokenizer, [{"role": "user", "content": text}]), False)
    out = model.generate([ids], max_new_tokens=tokens)[0]
    return model.tokenizer.decode(out), "max_tokens" if len(out) == tokens else "end_turn"


def bash(script: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, f"{script}\n{result.stderr[-3000:]}"
    return result


def python(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"{code}\n{result.stderr[-3000:]}"
    return result.stdout.splitlines()


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    assert len(README.splitlines()) <= 220
    setup, tests = BASH[0].strip(), BASH[1].strip()
    assert setup.startswith(INSTALL) and "moe-jax train" in setup
    ci = (ROOT / ".ci" / "run").read_text()
    for part in tests.split(" && "):  # the same steps, in the same order (CI installs quietly)
        assert part.replace("pip install -e", "pip install -q -e") in ci, part
    assert ci.index("install_test_browser") < ci.index("pip install") < ci.index("python -m pytest tests")


def test_the_main_job_and_the_quick_start_commands_run(tmp_path, offline):
    main = bash(BASH[0].strip().removeprefix(INSTALL), tmp_path)
    accuracy = re.search(r"held-out exact match: [\d.]+% at step 0 -> ([\d.]+)% at step \d+", main.stdout + main.stderr)
    assert accuracy and float(accuracy.group(1)) >= 90, main.stdout[-2000:]
    train, infer, chat = BASH[2:5]
    bash(train, tmp_path)
    assert (tmp_path / "runs" / "quick" / "adapter" / "adapter_config.json").exists()
    completions = bash(infer, tmp_path)
    assert "'copy srel >' ->" in completions.stdout and (tmp_path / "out.jsonl").read_text().count("\n") == 1
    answer, _ = chat_answer(offline, "copy srel >", 8)
    assert bash(chat, tmp_path).stdout.splitlines() == [answer] == ["srel"]


def test_the_python_api_example(offline):
    printed = python(PYTHON[2])
    assert printed[0] == str(offline.generate(["copy srel >"], max_new_tokens=8))
    assert printed[1] == offline.plan.summary()


def test_the_server_examples_answer_what_the_model_generates(bundled_server, offline):
    def against_server(code: str) -> list[str]:
        return python(code.replace("http://127.0.0.1:8000", bundled_server.url))

    answer, stop = chat_answer(offline, "copy srel >", 8)
    completion = offline.generate(["sort dcba >"], max_new_tokens=8)[0]
    # what the README says they print: the right answers, and what the model generates offline
    call = 'get_weather {"city": "paris"}'
    assert (answer, completion, stop) == ("srel", " abcd", "end_turn")
    assert against_server(PYTHON[0]) == [answer, completion, call]
    assert against_server(PYTHON[1]) == [f"{answer} {stop}"]
    assert f"`{answer}`, `{completion}` and `{call}`" in README
