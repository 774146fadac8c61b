"""LoRA fine-tuning: `moe-jax train --model DIR --data FILE --out DIR [--config configs/X.toml] [--backend host]`.

How it works and why: docs/INTERNALS.md, moe_jax/train/__main__.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from moe_jax import distributed
from moe_jax.cli import prog, run_cli
from moe_jax.formats.adapters import peft_unexpressible
from moe_jax.train.config import SETTINGS_HELP, TrainConfig
from moe_jax.train.loop import Trainer, load_run_data
from moe_jax.train.run_dir import prepare_run_dir


def _flag_type(field: dataclasses.Field):
    hint = typing.get_type_hints(TrainConfig)[field.name]
    if hint is bool:
        return None
    if typing.get_origin(hint) is list:
        return lambda s: [t.strip() for t in s.split(",") if t.strip()]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def parse_args(argv):
    p = argparse.ArgumentParser(prog=prog("train"), description=__doc__.splitlines()[0])
    p.add_argument("--config", help="TOML file with any of the settings below")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out (else refused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verify", action="store_true", help="check a converted model's expert checksums first")
    p.add_argument("--no-native", action="store_true", help="no native kernels or XLA FFI handlers (to compare)")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        what = SETTINGS_HELP[field.name]
        choices = TrainConfig.choices().get(field.name)
        if choices:  # listed, not enforced here: the config's own check names the setting in its error
            what += f": one of {', '.join(choices)}"
        if isinstance(default, list):  # the flag takes "a,b,c", so say the default that way
            help_text = f"{what}; comma-separated (default: {','.join(default)})"
        else:
            help_text = f"{what} (default: {default})"
        if kind is None:
            p.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(flag, dest=field.name, type=kind, default=None, help=help_text)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig.from_sources(args.config, overrides)
    world = distributed.join()
    world.rows(cfg.batch_size)  # a batch that does not split over the processes is refused now

    data = load_run_data(cfg)  # bad data stops here, before any model loading or compilation (or writing)
    if world.is_main:
        prepare_run_dir(cfg.out, args.resume, args.overwrite)  # so does a used or unwritable --out
    distributed.barrier()  # the others start once the run directory is ready
    say = print if world.is_main else lambda *a, **k: None
    s = data.stats
    say(
        f"data: {len(data.train)} training rows, {len(data.held_out)} held out; skipped {s.skipped_lines} bad "
        f"line(s), truncated {s.truncated}, dropped {s.dropped_too_long} too long and {s.dropped_no_target} "
        "without targets",
        file=sys.stderr,
    )
    for where in s.skipped_where[:5]:
        say(f"  skipped {where}", file=sys.stderr)
    native = False if args.no_native else None
    trainer = Trainer(cfg, data, progress=not args.no_progress, verify=args.verify, native=native)
    say(f"plan: {trainer.model.plan.summary()}", file=sys.stderr)
    not_for_peft = peft_unexpressible(trainer.lora_config, trainer.model.config)
    if not_for_peft:  # said before the run, not after hours of it
        say(f"note: the adapter will be in moe_jax's format only: {not_for_peft}", file=sys.stderr)
    summary = trainer.run(resume=args.resume)
    first, last = summary["first"], summary["last"]
    if "exact_match" in first and "exact_match" in last:
        say(
            f"held-out exact match: {first['exact_match']:.1%} at step {first['step']} -> "
            f"{last['exact_match']:.1%} at step {last['step']}"
        )
    if "eval_loss" in last:
        say(f"held-out loss: {first.get('eval_loss', float('nan')):.4f} -> {last['eval_loss']:.4f}")
    adapter_format = "moe_jax format only" if not_for_peft else "PEFT"
    tensorboard = f", TensorBoard events in {cfg.tensorboard}" if cfg.tensorboard else ""
    say(f"wrote {cfg.out}/adapter ({adapter_format}), {cfg.out}/metrics.jsonl, {cfg.out}/loss.png{tensorboard}")
    say(f"report: moe-jax report {cfg.out}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
