"""Models by Hugging Face Hub id, offline against a Hub cache laid out on disk as huggingface_hub lays it out
(`HF_HOME`, `HF_HUB_OFFLINE=1`: the commands run in a subprocess, since huggingface_hub reads both at import)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_jax import bundled
from moe_jax.formats.hub import hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(hf_home: Path, repo: str, files: dict[str, Path]) -> Path:
    """`files` (name in the repository: source) as huggingface_hub's cache holds revision main of `repo`."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, snapshot / name)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


def offline(hf_home: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env)


def test_what_names_a_hub_model(tmp_path, monkeypatch):
    assert hub_id("Qwen/Qwen3-30B-A3B") == ("Qwen/Qwen3-30B-A3B", None)
    assert hub_id("unsloth/Qwen3-30B-A3B-GGUF/Q4_0/model-Q4_0.gguf") == (
        "unsloth/Qwen3-30B-A3B-GGUF",
        "Q4_0/model-Q4_0.gguf",
    )
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("org/name") is None  # a directory that exists is a path
    assert hub_id("./org/name") is None and hub_id("/abs/dir") is None and hub_id("runs") is None
    assert hub_id("a/b/c") is None  # three parts that are not a GGUF file: a (missing) path


def test_a_checkpoint_and_a_gguf_file_load_by_id_from_the_cache(tmp_path):
    hf_home = tmp_path / "hf"
    cached_repo(hf_home, "moe-jax/tiny-moe", {f.name: f for f in bundled.MODEL.iterdir() if f.is_file()})
    prompt = ["-m", "moe_jax", "infer", "-p", "copy srel >", "--max-new-tokens", 6, "--out"]
    by_id = offline(hf_home, *prompt, tmp_path / "by_id.jsonl", "--model", "moe-jax/tiny-moe")
    by_path = offline(hf_home, *prompt, tmp_path / "by_path.jsonl", "--model", bundled.MODEL)
    assert by_id.returncode == by_path.returncode == 0, by_id.stderr
    completions = [json.loads((tmp_path / f).read_text())["completion"] for f in ("by_id.jsonl", "by_path.jsonl")]
    assert completions[0] == completions[1] and completions[0]
    converted = offline(hf_home, "-m", "moe_jax", "convert", "--hf", "moe-jax/tiny-moe", "--out", tmp_path / "conv")
    assert converted.returncode == 0 and (tmp_path / "conv" / "experts").is_dir(), converted.stderr

    pytest.importorskip("transformers")
    from tests.gguf_files import write_gguf
    from tests.hf_models import make_hf_model

    gguf_path = write_gguf(make_hf_model("qwen3_moe"), tmp_path / "model.gguf")
    cached_repo(hf_home, "moe-jax/tiny-gguf", {"Q8/model.gguf": gguf_path})
    code = (
        "import moe_jax, numpy as np; ids = np.arange(12).reshape(2, 6); "
        "a = moe_jax.load_model('moe-jax/tiny-gguf/Q8/model.gguf').logits(ids); "
        f"b = moe_jax.load_model({str(gguf_path)!r}).logits(ids); print(bool((a == b).all()))"
    )
    same = offline(hf_home, "-c", code)
    assert same.returncode == 0 and same.stdout.strip() == "True", same.stderr


def test_a_model_neither_here_nor_cached_is_one_clear_error(tmp_path):
    result = offline(tmp_path / "hf", "-m", "moe_jax", "infer", "-p", "x", "--model", "nobody/nothing-moe")
    assert result.returncode == 2
    assert "nobody/nothing-moe: no such directory, and not in the Hugging Face cache" in result.stderr
    assert "Traceback" not in result.stderr
