"""`python -m moe_jax.advise`: the command; its code is moe_jax/planning/advise.py."""

import sys

from moe_jax.cli import run_cli
from moe_jax.planning.advise import main

if __name__ == "__main__":
    sys.exit(run_cli(main))
