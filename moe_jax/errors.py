"""Errors that name the file, tensor or value at fault.

Every problem a user can cause (a bad directory, a wrong tensor, an out-of-range token id) is raised as one of
these, so the CLIs can print one line and exit non-zero instead of a traceback from deep inside JAX.
"""


class MoeJaxError(Exception):
    """Base class: a user-facing problem with a one-line explanation."""


class CheckpointError(MoeJaxError):
    """A checkpoint directory, file or tensor is missing, unreadable or misshapen."""


class ConfigError(MoeJaxError):
    """A config names an unsupported model type or has inconsistent values."""


class InputError(MoeJaxError, ValueError):
    """An argument given to the API is out of range (token ids, sampling settings, shapes)."""


def read_json_file(path, what: str) -> dict:
    """A JSON file's content; a missing or broken file is a CheckpointError naming it (`what` says what the
    directory was expected to be, for the missing case)."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found (is {path.parent} {what}?)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e


class MemoryLimitError(MoeJaxError):
    """What a load or a generation would allocate does not fit the memory this machine has free."""
