"""Monitoring figures of an expert backend, gathered from inside jit-compiled steps by host callbacks.

A co-compute system is watched through more than bus bandwidth: how long the host computed, how long the device
side waited for host results, how many bytes crossed the bus, what GFLOP/s and weight GB/s the host reached, and how
the routing spread tokens over experts (skew).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BackendMetrics:
    host_to_device_bytes: float = 0.0
    device_to_host_bytes: float = 0.0
    host_busy_s: float = 0.0  # summed over host worker threads
    host_wall_s: float = 0.0  # wall time of host expert calls
    device_wait_s: float = 0.0  # device side blocked waiting for host results
    host_wait_s: float = 0.0  # host side idle waiting for device inputs (hybrid collect before submit finished)
    host_flops: float = 0.0
    host_weight_bytes: float = 0.0
    host_calls: int = 0
    tokens_per_expert: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> counts

    def merged(self, other: BackendMetrics) -> BackendMetrics:
        """The two periods' figures together."""
        sums = {f: getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__ if f != "tokens_per_expert"}
        counts = {layer: c.copy() for layer, c in self.tokens_per_expert.items()}
        for layer, c in other.tokens_per_expert.items():
            _add_counts(counts, layer, c)
        return BackendMetrics(**sums, tokens_per_expert=counts)

    @property
    def host_gflops(self) -> float:
        return self.host_flops / self.host_wall_s / 1e9 if self.host_wall_s else 0.0

    @property
    def host_weight_gbps(self) -> float:
        return self.host_weight_bytes / self.host_wall_s / 1e9 if self.host_wall_s else 0.0

    def summary(self) -> dict:
        skew = {
            layer: float(c.max() / c.mean()) if c.sum() else 1.0 for layer, c in sorted(self.tokens_per_expert.items())
        }
        return {
            "host_to_device_MB": self.host_to_device_bytes / 1e6,
            "device_to_host_MB": self.device_to_host_bytes / 1e6,
            "host_busy_s": self.host_busy_s,
            "host_wall_s": self.host_wall_s,
            "device_wait_s": self.device_wait_s,
            "host_wait_s": self.host_wait_s,
            "host_gflops": self.host_gflops,
            "host_weight_gbps": self.host_weight_gbps,
            "routing_max_over_mean": skew,
        }


class MetricsRecorder:
    """Thread-safe accumulation; `take()` returns what was recorded since the last take and starts afresh."""

    def __init__(self):
        self._lock = threading.Lock()
        self._metrics = BackendMetrics()

    def add(self, **amounts):
        with self._lock:
            for key, value in amounts.items():
                setattr(self._metrics, key, getattr(self._metrics, key) + value)

    def count_tokens(self, layer: int, counts: np.ndarray):
        with self._lock:
            _add_counts(self._metrics.tokens_per_expert, layer, counts)

    def take(self) -> BackendMetrics:
        with self._lock:
            metrics, self._metrics = self._metrics, BackendMetrics()
        return metrics


class RoutingCounts:
    """Tokens routed to each expert of each layer since the last `take()`, recorded from inside compiled steps
    (all pairs, wherever they computed): what the expert cache learns from."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[int, np.ndarray] = {}

    def add(self, layer: int, counts):
        with self._lock:
            _add_counts(self._counts, layer, np.asarray(counts, np.int64))

    def take(self) -> dict[int, np.ndarray]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


def _add_counts(per_layer: dict[int, np.ndarray], layer: int, counts: np.ndarray):
    per_layer[layer] = per_layer[layer] + counts if layer in per_layer else counts.copy()
