"""Per-call statistics of the host expert engine, readable by callers after each forward or backward."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CallStats:
    kind: str  # "forward" or "backward"
    layer: int
    wall_s: float = 0.0
    busy_s: list[float] = field(default_factory=list)  # per worker, caller first
    flops: float = 0.0
    weight_bytes: float = 0.0
    tokens_per_expert: np.ndarray | None = None

    @property
    def imbalance(self) -> float:
        """Max over mean worker busy time: 1.0 is perfectly balanced."""
        mean = sum(self.busy_s) / len(self.busy_s) if self.busy_s else 0.0
        return max(self.busy_s) / mean if mean > 0 else 1.0

    @property
    def gflops(self) -> float:
        return self.flops / self.wall_s / 1e9 if self.wall_s else 0.0

    @property
    def weight_gbps(self) -> float:
        return self.weight_bytes / self.wall_s / 1e9 if self.wall_s else 0.0

    def add_busy(self, busy: list[float]):
        if not self.busy_s:
            self.busy_s = [0.0] * len(busy)
        self.busy_s = [a + b for a, b in zip(self.busy_s, busy, strict=True)]

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "layer": self.layer,
            "wall_s": self.wall_s,
            "busy_s": self.busy_s,
            "flops": self.flops,
            "weight_bytes": self.weight_bytes,
            "gflops": self.gflops,
            "weight_gbps": self.weight_gbps,
            "imbalance": self.imbalance,
            "tokens_per_expert": None if self.tokens_per_expert is None else self.tokens_per_expert.tolist(),
        }
