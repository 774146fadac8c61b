"""The device expert cache's policy: which experts each MoE layer keeps on the device, from routing statistics.

How it works and why: docs/INTERNALS.md, moe_jax/planning/expert_cache.py.
"""

from __future__ import annotations

import numpy as np

from moe_jax.errors import InputError


class ExpertCache:
    def __init__(
        self,
        layers: list[int],
        num_experts: int,
        expert_bytes: int,
        budget_bytes: int,
        decay: float = 0.8,
        max_swaps: int = 1,
        margin: float = 1.25,
    ):
        if not 0.0 <= decay < 1.0:
            raise InputError(f"expert cache decay must be in [0, 1), got {decay}")
        self.layers = list(layers)
        self.num_experts = num_experts
        self.expert_bytes = expert_bytes
        self.decay, self.max_swaps, self.margin = decay, max_swaps, margin
        self.heat = {layer: np.zeros(num_experts) for layer in self.layers}
        self.set_budget(budget_bytes)

    def set_budget(self, budget_bytes: int):
        if budget_bytes < 0:
            raise InputError(f"expert cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        per_layer = self.budget_bytes // (self.expert_bytes * max(1, len(self.layers)))
        self.capacity = int(min(self.num_experts, per_layer))

    @property
    def bytes_when_full(self) -> int:
        return self.capacity * self.expert_bytes * len(self.layers)

    def observe(self, counts_by_layer: dict[int, np.ndarray]):
        """Adds a step's routing counts; older steps fade by `decay` per call."""
        for layer in self.layers:
            self.heat[layer] *= self.decay
            if layer in counts_by_layer:
                self.heat[layer] += np.asarray(counts_by_layer[layer], float)

    def target(self, layer: int) -> list[int]:
        """The layer's most-routed experts, as many as fit (ties to the lower id; never-routed ones left out)."""
        heat = self.heat[layer]
        ranked = [int(e) for e in np.argsort(-heat, stable=True) if heat[e] > 0]
        return ranked[: self.capacity]

    def choose(self, layer: int, current: list[int]) -> list[int]:
        """The layer's cache after one update from `current`: at most `max_swaps` evictions, each for an expert
        `margin` times hotter than the one it replaces; free slots fill with the hottest uncached experts."""
        heat = self.heat[layer]
        cached = [e for e in current if e < self.num_experts][: self.capacity]
        wanted = [e for e in self.target(layer) if e not in cached]
        while wanted and len(cached) < self.capacity:
            cached.append(wanted.pop(0))
        for _ in range(self.max_swaps):
            if not wanted or not cached:
                break
            coldest = min(cached, key=lambda e: (heat[e], -e))
            if heat[wanted[0]] <= self.margin * heat[coldest]:
                break
            cached[cached.index(coldest)] = wanted.pop(0)
        return cached
