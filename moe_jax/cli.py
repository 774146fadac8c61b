"""What every command-line entry point shares: one-line errors and exit codes instead of tracebacks."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from host_kernels import HostKernelError
from moe_jax import distributed
from moe_jax.errors import InputError, MoeJaxError

MODEL_HELP = (
    "checkpoint directory, .gguf file, or Hugging Face Hub id such as Qwen/Qwen3-30B-A3B (default: the bundled model)"
)
INVOKED_AS: str | None = None  # the command line's name for the running command, when it is not `moe-jax NAME`
EXIT_BAD_INPUT = 2
EXIT_SYSTEM = 1  # the machine, not the input: a full disk, a file that vanished


def add_expert_shards_argument(p, alone: str):
    """--expert-shards N: expert parallel over the run's N processes; `alone` says what a process of a
    multi-process run does without it."""
    p.add_argument(
        "--expert-shards",
        type=int,
        default=1,
        metavar="N",
        help="expert parallel: each of the run's N processes (python -m moe_jax.launch -n N ...) holds 1/N of every "
        "layer's experts and a copy of the rest; process 0 runs the batch and the others compute their experts' "
        f"share of each step (host backend; default 1: {alone})",
    )


def check_expert_shards(shards: int):
    if shards < 1:
        raise InputError(f"--expert-shards must be >= 1, got {shards}")


def prog(name: str) -> str:
    """What a command's --help and errors call it: `moe-jax NAME`, or how a checkout's script was run."""
    return INVOKED_AS or f"moe-jax {name}"


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Runs `main`; a user-caused error prints `error: ...` to stderr and returns exit code 2, a system one (a full
    disk) exit code 1. A process of a multi-process run that fails leaves at once, so that the others' next
    collective fails too rather than waiting for it."""
    try:
        code = _run(main, argv)
    except BaseException:  # a bug: its traceback, then out (JAX's exit handshake would wait for the others)
        if not distributed.world().several:
            raise
        traceback.print_exc()
        code = EXIT_SYSTEM
    if code and distributed.world().several:
        distributed.leave_at_once(code)
    return code


def _run(main, argv) -> int:
    try:
        return main(argv) or 0
    except (MoeJaxError, HostKernelError) as e:
        where = f"{distributed.world().describe()}: " if distributed.world().several else ""
        print(f"error: {where}{e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a full or failing disk while writing outputs: say which file and why, in one line
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_SYSTEM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
