"""The run directory: a new run never mixes with an old one, and a resumed run is the same run.

train.py writes checkpoints/, metrics.jsonl, adapter/ and loss.png into --out (moe_jax.report its report.html).
A new run into a directory that holds any of them is refused (orbax would keep the old run's checkpoints,
skipping their steps, and a later --resume would restore the old state), unless --overwrite, which removes exactly
those entries first. The data files' content is fingerprinted at the first start and recorded in every
checkpoint, so --resume with a changed data file is refused like a changed setting.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from host_kernels import file_sha256
from moe_jax.errors import InputError
from moe_jax.output_files import check_writable_dir

RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "adapter", "loss.png", "report.html")  # report.html: moe_jax.report


def prepare_run_dir(out, resume: bool, overwrite: bool) -> Path:
    """Checks (and with `overwrite`, empties of a previous run's entries) the run directory `out`."""
    out = Path(out)
    if resume and overwrite:
        raise InputError("--resume continues the run in --out and --overwrite starts a new one: give one of them")
    previous = [name for name in RUN_ENTRIES if (out / name).exists() or (out / name).is_symlink()]
    if previous and not resume:
        if not overwrite:
            raise InputError(
                f"--out {out} holds a previous run ({', '.join(previous)}); pass --resume to continue it, "
                "--overwrite to replace it, or choose another --out"
            )
        for name in previous:
            entry = out / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return check_writable_dir(out, "--out")


def data_fingerprint(*files) -> dict[str, str]:
    """SHA-256 of each data file's content, by the path it was given as."""
    return {str(file): file_sha256(file) for file in files if file}
