"""Chat templates are untrusted code from a checkpoint: rendered in jinja2's sandbox, never able to run commands,
and every real template renders exactly as transformers renders it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_jax.errors import InputError
from moe_jax.formats.chat_template import render_template

ROOT = Path(__file__).resolve().parents[1]

# ways out of a plain jinja2 environment into os.system / open, each writing the marker file
ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "{{ messages.append({'role': 'x'}) }}{{ messages }}",  # the immutable sandbox: no changing the caller's data
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ dict.__class__.__init__.__globals__ }}",
    "{% for i in range(10**9) %}x{% endfor %}",  # the sandbox's range limit: an error, not a traceback
]


@pytest.mark.parametrize("template", ESCAPES)
def test_hostile_templates_are_refused_and_run_nothing(template, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InputError, match="chat template"):
        render_template(template, "tokenizer_config.json: ", messages=messages)
    assert not (tmp_path / "MARKER").exists()
    assert messages == [{"role": "user", "content": "hi"}]


REAL_TEMPLATES = {
    "plain": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "tools-json": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m | tojson(indent=2, sort_keys=True) }}"
    "\n{% endfor %}{{ {'ü': 'é'} | tojson }}",
    "namespace-and-loop-controls": "{% set ns = namespace(first=true, n=0) %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}{% if ns.first %}[FIRST]{% set ns.first = false %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m['content'] }}{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% endfor %}",
    "generation-block": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}> {{ m['content'] }}\n{% endif %}{% endfor %}",
    "raise-on-bad-role": "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}",
    "dict-and-date": "{% set d = dict(a=1, b=2) %}{{ d | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}"
    "{{ strftime_now('%Y') | length }}",
}


@pytest.mark.parametrize("name", list(REAL_TEMPLATES))
def test_real_templates_render_as_transformers_does(name):
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    template = REAL_TEMPLATES[name]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": 'copy ü "x" <b>'},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "done"},
    ]
    for generation_prompt in (True, False):
        specials = {"bos_token": "<s>", "eos_token": "</s>"}
        (want,), _ = render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=generation_prompt, **specials
        )
        got = render_template(template, messages=messages, add_generation_prompt=generation_prompt, **specials)
        assert got == want


def test_a_template_that_raises_is_an_input_error_naming_its_message():
    template = REAL_TEMPLATES["raise-on-bad-role"]
    with pytest.raises(InputError, match="bad role tool"):
        render_template(template, messages=[{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """The bundled model with a chat template that would write a marker file next to the run."""
    path = tmp_path_factory.mktemp("hostile") / "model"
    shutil.copytree(ROOT / "models" / "tiny-moe", path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = ESCAPES[0]
    config_file.write_text(json.dumps(config))
    return path


def _run(script, *args, cwd):
    command = [sys.executable, str(ROOT / script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd)


def test_infer_and_train_refuse_a_hostile_template_and_run_nothing(hostile_model, tmp_path):
    chat = {"messages": [{"role": "user", "content": "copy ab >"}, {"role": "assistant", "content": " ab"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(chat) + "\n")
    result = _run("infer.py", "--model", hostile_model, "--prompts", data, "--out", tmp_path / "o.jsonl", cwd=tmp_path)
    assert result.returncode == 2 and "unsafe" in result.stderr, result.stderr
    train = _run(
        "train.py", "--model", hostile_model, "--data", data, "--out", tmp_path / "run", "--max-steps", 1, cwd=tmp_path
    )
    assert train.returncode == 2 and "unsafe" in train.stderr, train.stderr
    assert not (tmp_path / "MARKER").exists()
