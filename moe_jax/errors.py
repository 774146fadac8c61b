"""Errors that name the file, tensor or value at fault.

Every problem a user can cause (a bad directory, a wrong tensor, an out-of-range token id) is raised as one of
these, so the CLIs can print one line and exit non-zero instead of a traceback from deep inside JAX.
"""

import json
import math
from pathlib import Path


class MoeJaxError(Exception):
    """Base class: a user-facing problem with a one-line explanation."""


class CheckpointError(MoeJaxError):
    """A checkpoint directory, file or tensor is missing, unreadable or misshapen."""


class ConfigError(MoeJaxError):
    """A config names an unsupported model type or has inconsistent values."""


class InputError(MoeJaxError, ValueError):
    """An argument given to the API is out of range (token ids, sampling settings, shapes)."""


class MemoryLimitError(MoeJaxError):
    """What a load or a generation would allocate does not fit the memory this machine has free."""


def read_json_file(path, what: str) -> dict:
    """A JSON file's content; a missing or broken file is a CheckpointError naming it (`what` says what the
    directory was expected to be, for the missing case)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found (is {path.parent} {what}?)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e


def is_int(value) -> bool:
    """An integer as a JSON file can hold one: `true` parses as a Python bool, which is an int, but not a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """A JSON number (not a bool, not NaN or infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
