"""The training loop: LoRA-only optax updates over deterministic batches, evaluation, checkpoints, outputs."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import moe_jax
from host_kernels import NonFiniteError
from moe_jax import distributed
from moe_jax.backends.placements import read_device_experts
from moe_jax.distributed import this_process_shard
from moe_jax.errors import ConfigError, InputError, MoeJaxError
from moe_jax.formats.adapters import export_peft
from moe_jax.formats.checkpoint import read_config
from moe_jax.formats.tokenizer import load_tokenizer
from moe_jax.generation import lockstep
from moe_jax.generation.generate import generate_tokens
from moe_jax.model.lora import LoRAConfig
from moe_jax.output_files import NewFile, create_new
from moe_jax.run_log import ExpertCounts, RunLog, backend_figures
from moe_jax.train.checkpoints import Checkpoints
from moe_jax.train.config import TrainConfig
from moe_jax.train.data import Batches, DataStats, Example, load_examples, pack, split_held_out
from moe_jax.train.objective import lora_value_and_grad
from moe_jax.train.run_dir import data_fingerprint


class TrainingError(MoeJaxError):
    """The run cannot go on (a non-finite loss); the last good checkpoint is left as it was."""


@dataclass
class RunData:
    train: list[Example]
    held_out: list[Example]
    stats: DataStats
    pad_id: int


def load_run_data(cfg: TrainConfig) -> RunData:
    """Everything about the data is read and checked before the model is loaded or anything compiles."""
    check_sequence_length(cfg)
    tokenizer = load_tokenizer(Path(cfg.model))
    if tokenizer is None:
        raise InputError(f"{cfg.model}: no tokenizer (needed to tokenise the training data)")
    stats = DataStats()
    train = load_examples(cfg.data, tokenizer, cfg.max_seq_len, cfg.long_examples, cfg.skip_bad_lines, stats)
    if cfg.eval_data:
        held_out = load_examples(cfg.eval_data, tokenizer, cfg.max_seq_len, cfg.long_examples, cfg.skip_bad_lines)
    else:
        train, held_out = split_held_out(train, cfg.eval_fraction, cfg.seed)
    if cfg.pack:
        train = pack(train, cfg.max_seq_len)
    pad = tokenizer.token_to_id("<pad>")
    return RunData(train, held_out, stats, pad if pad is not None else 0)


def check_sequence_length(cfg: TrainConfig):
    """max_seq_len must fit the model's positions: beyond them RoPE extrapolates and the loss means nothing."""
    model_config = read_config(cfg.model)
    if cfg.max_seq_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_seq_len {cfg.max_seq_len} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings} ({cfg.model})"
        )


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(cfg.learning_rate)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.learning_rate, 0.0, max(1, cfg.max_steps - cfg.warmup_steps))
    else:
        decay = optax.cosine_decay_schedule(cfg.learning_rate, max(1, cfg.max_steps - cfg.warmup_steps))
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps) if cfg.warmup_steps else None
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps]) if warmup else decay


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg)
    adamw = optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw


class Trainer:
    def __init__(
        self, cfg: TrainConfig, data: RunData, progress: bool = True, verify: bool = False, native: bool | None = None
    ):
        self.cfg, self.data, self.progress = cfg, data, progress
        self.world = distributed.world()  # several processes: each runs its rows of every batch (data parallel)
        self.rows = self.world.rows(cfg.batch_size)
        self.out = Path(cfg.out)
        self.data_sha256 = data_fingerprint(cfg.data, cfg.eval_data)
        budget = int(cfg.device_memory_mb * 2**20) or None
        self.model = moe_jax.load_model(
            cfg.model,
            backend=cfg.backend,
            dtype=cfg.dtype,
            quant=cfg.quant,
            host_threads=cfg.host_threads,
            device_budget_bytes=budget,
            verify=verify,
            native=native,
            device_experts=read_device_experts(cfg.device_experts) if cfg.device_experts else None,
            expert_shard=this_process_shard(cfg.expert_shards),
            pipeline=cfg.pipeline,
        )
        self.model.attach_lora(
            LoRAConfig(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets), cfg.lora_dropout), seed=cfg.seed
        )
        self.lora_config = self.model.lora_config  # the targets resolved for this model's family
        # data parallel: each process's gradients are of its rows; expert parallel's steps already span them all
        self.averages_gradients = self.world.several and self.model.expert_shard is None
        self.value_and_grad, self.lora_state = lora_value_and_grad(self.model)
        self.tx = make_optimizer(cfg)
        self.opt_state = self.tx.init(self.lora_state)
        self._update = jax.jit(self._apply)
        self.batches = Batches(data.train, cfg.batch_size, cfg.max_seq_len, data.pad_id, cfg.seed)
        self.checkpoints = Checkpoints(self.out / "checkpoints", cfg.keep_checkpoints, self.world)
        self.history: list[dict] = []

    def _apply(self, lora_state, opt_state, grads):
        updates, opt_state = self.tx.update(grads, opt_state, lora_state)
        lora_state = optax.apply_updates(lora_state, updates)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(lora_state)]))
        return lora_state, opt_state, finite

    def settings(self) -> dict:
        """What a resumed run must share with this one: the settings (dtype as loaded: "auto" and the dtype it
        chose are the same run) and the data files' content."""
        return {**self.cfg.as_dict(), "dtype": self.model.dtype, "data_sha256": self.data_sha256}

    def resume(self) -> int:
        step, self.lora_state, self.opt_state, meta = self.checkpoints.restore(
            self.lora_state, self.opt_state, self.settings()
        )
        self.history = meta.get("history", [])
        return step

    def step(self, step: int) -> tuple[float, int]:
        """One optimizer step (over grad_accum micro-batches); returns (loss, target tokens)."""
        total_loss, total_grads, targets = 0.0, None, 0
        self.model.refresh_expert_cache()  # backend="auto": the device cache follows the routing between steps
        for micro in range(self.cfg.grad_accum):
            index = step * self.cfg.grad_accum + micro
            tokens, mask = self.batches.batch(index)
            targets += int(mask[:, 1:].sum())
            tokens, mask = tokens[self.rows], mask[self.rows]
            # the dropout key depends on the batch index only, so a resumed run draws the same masks
            key = jax.random.fold_in(jax.random.key(self.cfg.seed), index) if self.cfg.lora_dropout else None
            if key is not None and self.averages_gradients:  # each process its own masks for its own rows
                key = jax.random.fold_in(key, self.world.index)
            try:
                loss, grads = self.model.run_jitted(self.value_and_grad, self.lora_state, tokens, mask, key)
            except NonFiniteError as e:
                raise TrainingError(f"step {step + 1}: the model diverged ({e}); {self._intact()}") from None
            if self.averages_gradients:  # the mean over every process's targets: one process on all rows' result
                loss, grads = distributed.weighted_mean((loss, grads), int(mask[:, 1:].sum()))
            total_loss += float(loss)
            total_grads = grads if total_grads is None else jax.tree.map(jnp.add, total_grads, grads)
        loss = total_loss / self.cfg.grad_accum
        if not math.isfinite(loss):
            raise TrainingError(f"step {step + 1}: loss is {loss}; {self._intact()}")
        if self.cfg.grad_accum > 1:
            total_grads = jax.tree.map(lambda g: g / self.cfg.grad_accum, total_grads)
        lora_state, opt_state, finite = self._update(self.lora_state, self.opt_state, total_grads)
        if not bool(finite):
            raise TrainingError(
                f"step {step + 1}: the update made LoRA weights non-finite (loss was {loss:.4g}); {self._intact()}"
            )
        self.lora_state, self.opt_state = lora_state, opt_state
        return loss, targets

    def _intact(self) -> str:
        step = self.checkpoints.latest_step()
        if step is None:
            return "stopping. No checkpoint was written yet: start again with a lower learning rate"
        return (
            f"stopping. The last good checkpoint (step {step}) in {self.checkpoints.directory} is intact "
            "(start a new run from scratch with a lower learning rate, or --resume from it)"
        )

    def evaluate(self) -> dict:
        held = self.data.held_out
        if not held:
            return {}
        batches = Batches(held, self.cfg.batch_size, self.cfg.max_seq_len, self.data.pad_id, 0)
        loss_sum, count = 0.0, 0
        for index in range(math.ceil(len(held) / self.cfg.batch_size)):  # each process its rows of each batch
            tokens, mask = batches.batch(index)
            mask[len(held) - index * self.cfg.batch_size :] = 0  # the last batch wraps around: each example once
            tokens, mask = tokens[self.rows], mask[self.rows]
            n = int(mask[:, 1:].sum())  # (expert parallel: the loss is all rows', and n * it sums to theirs)
            loss, _ = self.model.run_jitted(self.value_and_grad, self.lora_state, tokens, mask)
            loss_sum, count = loss_sum + float(loss) * n, count + n
        loss_sum, count = self._summed(loss_sum, count)
        result = {"eval_loss": loss_sum / max(count, 1)}
        if self.cfg.eval_exact_match:
            result["exact_match"] = self.exact_match(held[: self.cfg.eval_exact_match])
        return result

    def exact_match(self, examples: list[Example]) -> float | None:
        scored = [e for e in examples if e.prompt_text is not None and e.answer_text is not None]
        if not scored:
            return None
        self.model.set_lora_state(self.lora_state)
        tok = self.model.tokenizer
        longest = max(len(tok.encode(e.answer_text, add_special_tokens=False)) for e in scored) + 2

        def hits_of(examples: list[Example]) -> int:
            if not examples:
                return 0
            prompts = [e.ids[: len(e.ids) - sum(e.mask)] for e in examples]
            outs = generate_tokens(self.model, prompts, longest, 0.0, 1.0, 0)  # continuously batched
            return sum(
                tok.decode(o.tokens).strip() == e.answer_text.strip() for o, e in zip(outs, examples, strict=True)
            )

        if self.model.expert_shard is not None:  # process 0 generates them all, the others their experts' share
            hits = lockstep.run(self.model, lambda: hits_of(scored)) or 0
        else:
            hits = hits_of(self.world.share(scored))
        return self._summed(hits)[0] / len(scored)

    def _summed(self, *values: float) -> tuple[float, ...]:
        """`values` summed over the run's processes (each evaluates its part of the held-out set)."""
        if not self.world.several:
            return values
        return tuple(float(v) for v in distributed.sum_over_processes(values))

    def save(self, step: int):
        meta = {
            "step": step,
            "data_position": step * self.cfg.batch_size * self.cfg.grad_accum,
            "config": self.settings(),
            "history": self.history,
        }
        self.checkpoints.save(step, self.lora_state, self.opt_state, meta)

    def run(self, resume: bool = False) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        start = self.resume() if resume and self.checkpoints.latest_step() is not None else 0
        if start == 0:
            self.history = [{"step": 0, **self.evaluate()}]
        # rewritten from the checkpoint's history: steps after it (before a kill) are run again
        main = self.world.is_main  # writes the run's outputs; every process computes
        # replaces a link there, never writes through it
        metrics_file = create_new(self.out / "metrics.jsonl") if main else None
        log = RunLog(metrics_file, Path(cfg.tensorboard) if cfg.tensorboard and main else None)
        for record in self.history:
            log.write(record)
        schedule, counts = learning_rate_schedule(cfg), ExpertCounts()
        bar = tqdm(
            range(start, cfg.max_steps),
            initial=start,
            total=cfg.max_steps,
            desc="training",
            disable=not (self.progress and main),
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.model.metrics()
        try:
            for step in bar:
                t0 = time.perf_counter()
                loss, targets = self.step(step)
                elapsed = time.perf_counter() - t0
                backend = self.model.metrics()
                counts.add(backend)
                record = {
                    "step": step + 1,
                    "loss": loss,
                    "lr": float(schedule(step)),
                    "tokens_per_s": cfg.batch_size * cfg.grad_accum * cfg.max_seq_len / elapsed,
                    "target_tokens": targets,
                    **backend_figures(backend, elapsed),
                    **self._per_process(backend),
                }
                evaluated = (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.max_steps
                if evaluated:
                    record.update(self.evaluate())
                    self.model.metrics()  # the evaluation's generation is not the next step's figures
                self.history.append(record)  # (the checkpoints' history: without the expert counts)
                log.write({**record, "tokens_per_expert": counts.take()} if evaluated else record)
                bar.set_postfix(_postfix(record), refresh=False)
                if (step + 1) % cfg.checkpoint_interval == 0 or step + 1 == cfg.max_steps:
                    self.save(step + 1)
        finally:
            log.close()
            bar.close()
        return self.finish()

    def _per_process(self, backend) -> dict:
        """Several processes: each one's host busy and device wait seconds this step (process 0's are the
        record's own figures)."""
        if not self.world.several:
            return {}
        every = distributed.gather(np.array([backend.host_busy_s, backend.device_wait_s], np.float32))
        return {"host_busy_s_per_process": every[:, 0].tolist(), "device_wait_s_per_process": every[:, 1].tolist()}

    def finish(self) -> dict:
        self.model.set_lora_state(self.lora_state)
        if self.world.is_main:
            export_peft(self.model.transformer, self.lora_config, self.out / "adapter", self.cfg.model)
            plot_losses(self.history, self.out / "loss.png")
        evaluated = [h for h in self.history if "exact_match" in h or "eval_loss" in h]
        first, last = (evaluated[0], evaluated[-1]) if evaluated else ({}, {})
        return {"first": first, "last": last, "steps": self.cfg.max_steps, "out": str(self.out)}


def _postfix(record: dict) -> dict:
    shown = {
        "loss": f"{record['loss']:.3f}",
        "tok/s": f"{record['tokens_per_s']:.0f}",
        "host": f"{record['host_busy_s']:.2f}s",
        "wait": f"{record['device_wait_s']:.2f}s",
        "GB/s": f"{record['host_weight_gbps']:.1f}",
    }
    if "exact_match" in record and record["exact_match"] is not None:
        shown["acc"] = f"{record['exact_match']:.2f}"
    return shown


def plot_losses(history: list[dict], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out loss")
    accs = [(h["step"], h["exact_match"]) for h in history if h.get("exact_match") is not None]
    if accs:
        ax2 = ax.twinx()
        ax2.plot(*zip(*accs, strict=True), "s--", color="tab:green", label="held-out exact match")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("exact match")
        ax2.legend(loc="center right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend(loc="lower left")
    fig.tight_layout()
    try:
        with NewFile(path) as out:  # matplotlib would write through a link at `path`
            fig.savefig(out.tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
