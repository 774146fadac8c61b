"""train.py's run directory: a new run never mixes with an old one, --resume is the same run or refused with each
difference named, a corrupt newest checkpoint falls back to the one before, outputs never follow a link."""

import os
import shutil
import stat

import jax.numpy as jnp
import pytest

from moe_jax.errors import CheckpointError, InputError, MoeJaxError
from moe_jax.output_files import NewFile, current_umask, write_text
from moe_jax.train.loop import Trainer, load_run_data
from moe_jax.train.run_dir import prepare_run_dir
from tests.test_train import TRAIN, quick_config


def _trainer(out, **changes):
    cfg = quick_config(out, **changes)
    return Trainer(cfg, load_run_data(cfg), progress=False)


def test_a_new_run_into_a_used_out_is_refused_and_overwrite_removes_only_the_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "4").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "my-notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="holds a previous run .*checkpoints, metrics.jsonl.*--overwrite"):
        prepare_run_dir(out, resume=False, overwrite=False)
    assert (out / "checkpoints" / "4").exists()
    with pytest.raises(InputError, match="give one of them"):
        prepare_run_dir(out, resume=True, overwrite=True)
    prepare_run_dir(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["my-notes.txt"]
    prepare_run_dir(out, resume=True, overwrite=False)  # resuming a directory is what --resume is for


def test_an_unwritable_out_is_refused_before_anything_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError, match="cannot write there"):
        prepare_run_dir(blocker / "run", resume=False, overwrite=False)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """4 steps with checkpoints at 2 and 4, on a private copy of the training data."""
    root = tmp_path_factory.mktemp("run")
    data = root / "train.jsonl"
    shutil.copy(TRAIN, data)
    settings = dict(data=str(data), max_steps=4, checkpoint_interval=2, keep_checkpoints=2)
    trainer = _trainer(root / "out", **settings)
    trainer.run()
    return root / "out", settings


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(adam_b2=0.99), "adam_b2: 0.999 then, 0.99 now"),
        (dict(max_grad_norm=0.5), "max_grad_norm: 1.0 then, 0.5 now"),
        (dict(dtype="bfloat16"), "dtype: 'float32' then, 'bfloat16' now"),
    ],
)
def test_resume_with_changed_settings_is_refused_naming_each(finished_run, change, named):
    out, settings = finished_run
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(")):
        _trainer(out, **settings, **change).resume()


def test_resume_with_a_changed_data_file_is_refused(finished_run, tmp_path):
    out, settings = finished_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    data = tmp_path / "train.jsonl"
    shutil.copy(settings["data"], data)
    with data.open("a") as f:
        f.write('{"text": "one more line"}\n')
    moved = {**settings, "data": str(data)}
    with pytest.raises(CheckpointError, match="data_sha256"):
        _trainer(copy, **moved).resume()


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(finished_run, tmp_path, capsys):
    out, settings = finished_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    for file in (copy / "checkpoints" / "4").rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    assert _trainer(copy, **settings).resume() == 2
    assert "checkpoints/4: cannot restore" in capsys.readouterr().err


def test_outputs_replace_links_instead_of_writing_through_them(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / "metrics.jsonl").symlink_to(victim)
    (out / "loss.png").symlink_to(victim)
    _trainer(out, max_steps=1).run()
    assert victim.read_text() == "precious"
    assert not (out / "metrics.jsonl").is_symlink() and (out / "metrics.jsonl").read_text().count("\n") == 2
    assert not (out / "loss.png").is_symlink()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_mode_the_umask_gives_new_files(tmp_path, umask):
    previous = os.umask(umask)
    try:
        assert current_umask() == umask
        write_text(tmp_path / "report.html", "<html></html>")
        with NewFile(tmp_path / "out.jsonl") as out:
            out.write("{}\n")
    finally:
        os.umask(previous)
    for name in ("report.html", "out.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_divergence_before_any_checkpoint_says_none_was_written(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3, eval_data=None, eval_fraction=0.0)
    original = trainer.value_and_grad

    def nan_loss(state, tokens, mask, key=None):
        loss, grads = original(state, tokens, mask, key)
        return jnp.float32(jnp.nan), grads

    trainer.value_and_grad = nan_loss
    with pytest.raises(MoeJaxError, match="step 1: loss is nan; stopping. No checkpoint was written yet"):
        trainer.run()


def test_a_failed_checkpoint_save_is_a_checkpoint_error_and_earlier_ones_stay(finished_run, tmp_path, monkeypatch):
    out, settings = finished_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    trainer = _trainer(copy, **settings)
    trainer.resume()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.checkpoints.manager, "save", full_disk)
    with pytest.raises(CheckpointError, match="saving the step 6 checkpoint failed .*No space left on device"):
        trainer.save(6)
    assert sorted(p.name for p in (copy / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


def test_write_errors_name_the_file_and_the_cli_says_it_in_one_line(capsys):
    import os
    from pathlib import Path

    from moe_jax.cli import EXIT_SYSTEM, run_cli
    from moe_jax.output_files import _NamedFile

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")

    def main(argv):
        out = _NamedFile(os.open("/dev/full", os.O_WRONLY), Path("/dev/full"))
        out.write("x" * 10000)
        out.flush()

    assert run_cli(main) == EXIT_SYSTEM
    assert capsys.readouterr().err.strip() == "error: /dev/full: No space left on device"
