"""`python train.py` in a checkout: the same command as `moe-jax train` (moe_jax/train/__main__.py)."""

import sys

from moe_jax import cli
from moe_jax.train.__main__ import main, parse_args  # noqa: F401  (parse_args: for scripts that build the flags)

if __name__ == "__main__":
    cli.INVOKED_AS = "python train.py"
    sys.exit(cli.run_cli(main))
