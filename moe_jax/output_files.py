"""Writing outputs without following links out of the output directory and without half-written files.

An entry already at the target path (a file someone left, or a symlink pointing anywhere) is replaced, never
written through: files are created new (O_EXCL, so not through a link) under a unique temporary name in the same
directory and renamed over the target, which replaces a link itself, not what it points to.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from moe_jax.errors import InputError


def current_umask() -> int:
    """The process's umask, read without setting it (os.umask can only be read by changing it, which another
    thread creating a file meanwhile would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_writable_dir(directory, what: str) -> Path:
    """Creates `directory` if needed and proves a file can be made in it; an InputError naming `what` if not.
    Called before any expensive work, so an unwritable output fails in a second, not after the run."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{what} {directory}: cannot write there ({e.strerror or e})") from None
    return directory


class _NamedFile:
    """A text file whose write errors (a full disk) name the file they concern, which raw writes do not."""

    def __init__(self, fd: int, path: Path):
        self._file, self.path = os.fdopen(fd, "w", encoding="utf-8"), path

    def _named(self, operation, *args):
        try:
            return operation(*args)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def write(self, text: str):
        self._named(self._file.write, text)

    def flush(self):
        self._named(self._file.flush)

    def sync_and_close(self):
        self._named(self._file.flush)
        self._named(os.fsync, self._file.fileno())
        self._file.close()

    def close(self):
        try:
            self._named(self._file.close)
        finally:
            if not self._file.closed:  # a failed flush leaves it open; the data is lost either way
                with contextlib.suppress(OSError):
                    self._file.close()


class NewFile:
    """A text file written under a temporary name beside `path` and renamed onto it by `commit()` (an existing
    entry at `path`, link or file, is replaced; a link is never followed). `discard()` removes the temporary
    file; `keep_partial_as` renames what was written so far instead (a failed run keeps its finished records).
    As a context manager: committed when the block ends, discarded when it raises."""

    def __init__(self, path):
        self.path = Path(path)
        fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's file is private; the output is like any new file
        self.tmp = Path(name)
        self.file = _NamedFile(fd, self.path)

    def write(self, text: str):
        self.file.write(text)

    def flush(self):
        self.file.flush()

    def commit(self):
        self._close()
        os.replace(self.tmp, self.path)

    def keep_partial_as(self, path):
        self._close()
        os.replace(self.tmp, path)

    def discard(self):
        with contextlib.suppress(OSError):  # discarding after a full disk: the close may fail again
            self.file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        """Commits when the block ends normally, discards when it raises."""
        if kind is None:
            self.commit()
        else:
            self.discard()

    def _close(self):
        self.file.sync_and_close()


def write_text(path, text: str):
    """`text` into `path`, atomically and without following a link at `path`."""
    with NewFile(path) as out:
        out.write(text)


def create_new(path):
    """`path` opened for writing as a new file: whatever entry was there (a file, or a link, which is removed,
    not followed) is replaced; O_EXCL makes the open fail rather than write through a link put back meanwhile.
    For files written as a run goes (metrics.jsonl), which `tail -f` should see at their real name."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    return _NamedFile(fd, path)
