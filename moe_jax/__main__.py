"""`moe-jax COMMAND [options]` (or `python -m moe_jax COMMAND`): every command of the tool behind one name.
`moe-jax COMMAND --help` describes a command's options. With no options, train, infer, chat and serve run the
bundled default model (inside the package), so they work from a plain `pip install`."""

from __future__ import annotations

import difflib
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from moe_jax import cli

COMMANDS = {  # name: (module with main(argv), what it does)
    "train": ("moe_jax.train.__main__", "LoRA fine-tuning on a JSONL dataset (the bundled task by default)"),
    "infer": ("moe_jax.infer", "batch generation from a JSONL of prompts, or one prompt with -p"),
    "chat": ("moe_jax.chat", "an interactive chat with a model, streamed, in its chat template"),
    "serve": ("moe_jax.serve", "an OpenAI- and Anthropic-compatible HTTP server with continuous batching"),
    "convert": ("moe_jax.convert", "convert a Hugging Face or GGUF checkpoint (experts stored for the host)"),
    "doctor": ("moe_jax.doctor", "what this machine can run: CPU features, native kernels, the plan"),
    "advise": ("moe_jax.planning.advise", "which backend, dtype and format fit a model on this machine"),
    "report": ("moe_jax.report", "an HTML report of a training or generation run"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "usage: moe-jax COMMAND [options]   (moe-jax COMMAND --help for its options)\n\ncommands:\n" + "\n".join(
        lines
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else cli.EXIT_BAD_INPUT
    if argv[0] == "--version":
        try:
            print(f"moe-jax {version('moe_jax')}")
        except PackageNotFoundError:
            print("moe-jax (not installed: running from a checkout)")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"error: no command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return cli.EXIT_BAD_INPUT
    cli.INVOKED_AS = f"moe-jax {name}"
    return cli.run_cli(importlib.import_module(COMMANDS[name][0]).main, rest)


if __name__ == "__main__":
    sys.exit(main())
