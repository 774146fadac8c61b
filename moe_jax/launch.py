"""Starts a multi-process run on this machine: `python -m moe_jax.launch -n 2 train.py --config X.toml ...`.

How it works and why: docs/INTERNALS.md, moe_jax/launch.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from moe_jax.distributed import COORDINATOR, HEARTBEAT_TIMEOUT_S, NUM_PROCESSES, PROCESS_ID
from moe_jax.serving.process import free_port

GRACE_S = 3 * HEARTBEAT_TIMEOUT_S  # how long the others get to notice a failed process and stop


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m moe_jax.launch", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--processes", type=int, required=True, help="how many processes")
    p.add_argument("-m", dest="module", help="run a module (as python -m) instead of a script")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the script and its arguments")
    argv = sys.argv[1:] if argv is None else list(argv)
    # what follows `-m MODULE` is the module's own (argparse would read its options as the launcher's)
    module_at = _module_flag(argv)
    if module_at is not None and module_at + 1 < len(argv):
        args = p.parse_args(argv[: module_at + 2])
        args.command = argv[module_at + 2 :]
        return _checked(p, args)
    return _checked(p, p.parse_args(argv))


def _module_flag(argv: list[str]) -> int | None:
    """Where the launcher's own `-m` is: before the script (a script's own `-m` is the script's)."""
    i = 0
    while i < len(argv):
        if argv[i] == "-m":
            return i
        if argv[i] in ("-n", "--processes"):
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return None  # the script
    return None


def _checked(p, args):
    if args.processes < 1:
        p.error(f"-n must be >= 1, got {args.processes}")
    if args.module is None and not args.command:
        p.error("give a script to run (or -m module)")
    return args


def _relay(stream, index: int):
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(f"[{index}] ".encode() + line)
        sys.stdout.flush()


def launch(processes: int, command: list[str]) -> int:
    """Runs `command` (after the interpreter) as `processes` processes of one run; the first failure's exit code."""
    port = free_port()
    children, relays = [], []
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // processes
    for index in range(processes):
        env = {
            **os.environ,
            COORDINATOR: f"127.0.0.1:{port}",
            NUM_PROCESSES: str(processes),
            PROCESS_ID: str(index),
            "PYTHONUNBUFFERED": "1",
        }
        child = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if share:  # set before the interpreter starts any thread of its own: they all inherit it
            os.sched_setaffinity(child.pid, cores[index * share : (index + 1) * share])
        relay = threading.Thread(target=_relay, args=(child.stdout, index), daemon=True)
        relay.start()
        children.append(child)
        relays.append(relay)
    failure, deadline = 0, None
    while any(c.poll() is None for c in children):
        codes = [c.returncode for c in children if c.returncode]
        if codes and deadline is None:
            failure, deadline = codes[0], time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for c in children:
                if c.poll() is None:
                    c.kill()
        time.sleep(0.2)
    for relay in relays:
        relay.join(5)
    return failure or next((c.returncode for c in children if c.returncode), 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = ["-m", args.module, *args.command] if args.module else args.command
    return launch(args.processes, command)


if __name__ == "__main__":
    sys.exit(main())
