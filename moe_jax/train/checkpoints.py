"""Training checkpoints with orbax: LoRA parameters, optimizer state, step, data position and run settings.

Orbax writes each step into a temporary directory and renames it on commit, so a process killed at any moment
(kill -9 included) leaves either the previous complete checkpoints or the new one, never a half-written step that
`--resume` would pick up. In a multi-process run the state is the same in every process (data parallel): process
0 writes it, once, and every process reads it back on resume (the directory must be shared, or copied).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from moe_jax.distributed import World
from moe_jax.errors import CheckpointError

logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every save at INFO

# settings that must match for a resumed run to continue the same run
RESUME_KEYS = (
    "model",
    "data",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "batch_size",
    "grad_accum",
    "max_seq_len",
    "seed",
    "pack",
    "learning_rate",
    "schedule",
    "warmup_steps",
    "max_steps",
    "weight_decay",
    "max_grad_norm",
    "adam_b1",
    "adam_b2",
    "adam_eps",
    "dtype",
    "eval_data",
    "eval_fraction",
    "long_examples",
    "skip_bad_lines",
    "data_sha256",  # the data files' content (run_dir.data_fingerprint), not only their paths
)


class Checkpoints:
    def __init__(self, directory, keep: int, world: World | None = None):
        self.directory = Path(directory).absolute()
        world = world or World()
        self.writes = world.is_main
        # each process on its own as far as orbax knows: it would otherwise wait for all at every save
        alone = ocp.options.MultiprocessingOptions(primary_host=world.index, active_processes={world.index})
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=False, multiprocessing_options=alone
        )
        self.directory.mkdir(parents=True, exist_ok=True)  # (orbax will not create it for a process on its own)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, lora_state, opt_state, meta: dict):
        if not self.writes:
            return
        # as numpy: orbax will not write a process's own jax arrays in a multi-process run (the values are the same)
        state = jax.tree.map(np.asarray, {"lora": nnx.to_pure_dict(lora_state), "opt": opt_state})
        try:
            self.manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            )
            self.manager.wait_until_finished()
        except Exception as e:  # orbax raises many kinds (a full disk among them); orbax renames only finished saves
            raise CheckpointError(
                f"{self.directory}: saving the step {step} checkpoint failed ({type(e).__name__}: {e}); "
                "the checkpoints before it are as they were"
            ) from e

    def restore(self, lora_state, opt_state, settings: dict):
        """(step, LoRA state, optimizer state, meta) of the newest readable checkpoint, checked against
        `settings`. A checkpoint that cannot be read is skipped for the one before it, saying so."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"{self.directory}: no checkpoint to resume from")
        abstract = {"lora": nnx.to_pure_dict(lora_state), "opt": opt_state}
        abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)  # read back as numpy
        failures = []
        for step in steps:
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
                )
            except Exception as e:  # orbax raises many kinds; the user needs the path and the reason
                failures.append(f"{self.directory}/{step}: cannot restore ({type(e).__name__}: {e})")
                print(f"warning: {failures[-1]}; trying the checkpoint before it", file=sys.stderr)
                continue
            meta = restored.meta
            _check_same_run(self.directory, meta.get("config", {}), settings)
            state = jax.tree.map(jnp.asarray, restored.state)
            nnx.replace_by_pure_dict(lora_state, state["lora"])
            return step, lora_state, state["opt"], meta
        raise CheckpointError("no readable checkpoint: " + "; ".join(failures))


def _check_same_run(directory, saved: dict, settings: dict):
    changed = [k for k in RESUME_KEYS if saved.get(k) != settings.get(k)]
    if changed:
        lines = "; ".join(f"{k}: {_shown(saved.get(k))} then, {_shown(settings.get(k))} now" for k in changed)
        raise CheckpointError(
            f"{directory}: the checkpoint was made with different settings ({lines}); resume with the same "
            "settings and data, or start a new run (--overwrite or another --out)"
        )


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
