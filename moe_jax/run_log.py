"""A run's figures as it goes: one JSON record per step (train.py) or per finished request (infer.py) in a JSONL
file, and the same numbers as TensorBoard scalars when asked (`--tensorboard DIR` on both CLIs).
`moe-jax report` draws the JSONL file.

How it works and why: docs/INTERNALS.md, moe_jax/run_log.py.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from moe_jax.backends.metrics import BackendMetrics

# record key -> TensorBoard tag (grouped by the part before "/"); numbers under other keys keep their own name
TAGS = {
    "loss": "train/loss",
    "eval_loss": "train/held_out_loss",
    "exact_match": "train/held_out_exact_match",
    "lr": "train/learning_rate",
    "tokens_per_s": "speed/tokens_per_s",
    "host_busy_pct": "host/busy_pct",
    "host_gflops": "host/gflops",
    "host_weight_gbps": "host/weight_gbps",
    "device_wait_s": "wait/device_waits_for_host_s",
    "host_wait_s": "wait/host_waits_for_device_s",
    "bus_gbps": "bus/gbps",
    "expert_skew": "experts/max_over_mean",
    "anchor_hits": "anchor_cache/hits",
    "anchor_reused_tokens": "anchor_cache/reused_tokens",
    "draft_acceptance": "speculation/acceptance",
}


def backend_figures(metrics: BackendMetrics, elapsed_s: float) -> dict:
    """A step's backend figures (`metrics` taken over the step, `elapsed_s` its wall time) as record fields."""
    summary = metrics.summary()
    skew = list(summary["routing_max_over_mean"].values())
    moved = metrics.host_to_device_bytes + metrics.device_to_host_bytes
    return {
        "host_busy_s": metrics.host_busy_s,
        "host_busy_pct": 100.0 * metrics.host_wall_s / elapsed_s if elapsed_s > 0 else 0.0,
        "device_wait_s": metrics.device_wait_s,
        "host_wait_s": metrics.host_wait_s,
        "bus_gbps": moved / elapsed_s / 1e9 if elapsed_s > 0 else 0.0,
        "host_gflops": metrics.host_gflops,
        "host_weight_gbps": metrics.host_weight_gbps,
        "expert_skew": sum(skew) / len(skew) if skew else None,
    }


class ExpertCounts:
    """Tokens per expert of each layer, summed over steps until `take()`."""

    def __init__(self):
        self.counts: dict[int, np.ndarray] = {}

    def add(self, metrics: BackendMetrics):
        for layer, counts in metrics.tokens_per_expert.items():
            self.counts[layer] = self.counts[layer] + counts if layer in self.counts else counts.copy()

    def take(self) -> dict[str, list[int]]:
        counts, self.counts = self.counts, {}
        return {str(layer): [int(n) for n in c] for layer, c in sorted(counts.items())}


class GenerationMonitor:
    """infer.py's figures: a record per finished prompt (the backend's figures since the previous one, the finished
    completions' tokens per second since the start, anchor-cache hits, speculation's acceptance), the run's totals,
    and at `close()` a last record with every layer's tokens per expert."""

    def __init__(self, model, log: RunLog, cache=None):
        self.model, self.log, self.cache = model, log, cache
        self.total, self.counts = BackendMetrics(), ExpertCounts()
        self.finished, self.tokens = 0, 0
        self.start = self.last = time.perf_counter()

    def take(self) -> BackendMetrics:
        metrics = self.model.metrics()
        self.total = self.total.merged(metrics)
        self.counts.add(metrics)
        return metrics

    def finish(self, completion_tokens: int, drafts: tuple[int, int] | None = None):
        """A prompt finished with `completion_tokens`; `drafts`: (accepted, verified) drafts of the run so far, with
        speculative decoding."""
        now = time.perf_counter()
        metrics, elapsed = self.take(), now - self.last
        self.finished, self.tokens, self.last = self.finished + 1, self.tokens + completion_tokens, now
        record = {
            "step": self.finished,
            "tokens_per_s": self.tokens / (now - self.start),
            "completion_tokens": completion_tokens,
            **backend_figures(metrics, elapsed),
        }
        if drafts is not None:
            accepted, drafted = drafts
            record.update(drafted_tokens=drafted, draft_acceptance=accepted / drafted if drafted else None)
        if self.cache is not None:
            summary = self.cache.summary()
            record.update(
                anchor_hits=summary["hits"], anchor_reused_tokens=summary["prompt_tokens"] - summary["prefilled_tokens"]
            )
        self.log.write(record)

    def close(self):
        self.take()
        self.log.write({"step": self.finished, "tokens_per_expert": self.counts.take()})
        self.log.close()


class RunLog:
    """Writes records to an open JSONL file (`file`, possibly None) and, with `tensorboard`, a TensorBoard event
    directory; `close()` closes both."""

    def __init__(self, file, tensorboard: Path | None = None):
        self.file = file
        self.tensorboard = None
        if tensorboard is not None:
            from tensorboardX import SummaryWriter  # deferred: only runs asked for TensorBoard pay for its import

            self.tensorboard = SummaryWriter(str(tensorboard), flush_secs=5)

    def write(self, record: dict):
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    if math.isfinite(value):
                        self.tensorboard.add_scalar(TAGS.get(key, key), value, record["step"])

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
