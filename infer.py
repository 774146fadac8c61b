"""`python infer.py` in a checkout: the same command as `moe-jax infer` (moe_jax/infer.py)."""

import sys

from moe_jax import cli
from moe_jax.infer import main, parse_args  # noqa: F401  (parse_args: for scripts that build the flags)

if __name__ == "__main__":
    cli.INVOKED_AS = "python infer.py"
    sys.exit(cli.run_cli(main))
