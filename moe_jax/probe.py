"""`python -m moe_jax.probe`: the command; its code is moe_jax/planning/probe.py."""

import sys

from moe_jax.cli import run_cli
from moe_jax.planning.probe import main

if __name__ == "__main__":
    sys.exit(run_cli(main))
