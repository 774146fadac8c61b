"""`moe_jax.convert` never deletes what it did not create: an existing --out, a sibling OUT.partial, the source."""

import subprocess
import sys

import pytest

from moe_jax.convert import convert
from moe_jax.errors import InputError
from tests.hf_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "mixtral"
    save_hf_model(make_hf_model("mixtral", seed=7), path)
    return path


def _tree(path):
    return sorted((p.relative_to(path).as_posix(), p.read_bytes() if p.is_file() else b"") for p in path.rglob("*"))


def test_an_existing_non_empty_out_is_refused_unless_overwrite(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty; pass --overwrite"):
        convert(source, out, progress=False)
    assert (out / "notes.txt").read_text() == "mine"
    convert(source, out, progress=False, overwrite=True)
    assert (out / "experts" / "manifest.json").exists() and not (out / "notes.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no set-aside or partial directory left


def test_an_empty_out_is_used(source, tmp_path):
    (tmp_path / "out").mkdir()
    convert(source, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_sibling_partial_directory_is_never_touched(source, tmp_path):
    theirs = tmp_path / "out.partial"
    theirs.mkdir()
    (theirs / "data.bin").write_bytes(b"\x01\x02")
    convert(source, tmp_path / "out", progress=False)
    assert (theirs / "data.bin").read_bytes() == b"\x01\x02"


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_out_may_not_be_inside_equal_to_or_around_the_source(source, tmp_path, where):
    before = _tree(source)
    out = {"same": source, "inside": source / "converted", "contains": source.parent}[where]
    with pytest.raises(InputError, match="source"):
        convert(source, out, progress=False, overwrite=True)
    assert _tree(source) == before


def test_a_failed_conversion_leaves_nothing_behind(source, tmp_path, monkeypatch):
    from host_kernels import store

    def disk_full(self, layer, w13, w2):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.StoreWriter, "add_layer", disk_full)
    with pytest.raises(InputError, match="No space left"):
        convert(source, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_out_is_one_line_not_a_traceback(source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cmd = [sys.executable, "-m", "moe_jax.convert", "--hf", str(source), "--out", str(blocker / "sub")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error:") and "Traceback" not in result.stderr
