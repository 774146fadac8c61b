"""The device memory budget shared between the KV cache and the expert weights a backend keeps on the device: the
one place that turns a fraction or a byte count into the two shares (load_model, Model.set_memory_split)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_jax.errors import InputError


@dataclass(frozen=True)
class MemorySplit:
    budget: int  # device bytes for the two together
    kv: int | None  # the KV cache's share; None: not set (the experts may use the whole budget)

    @property
    def experts(self) -> int:
        return self.budget - (self.kv or 0)


def split_device_memory(budget: int | None, kv_fraction: float | None = None, kv_bytes: int | None = None):
    """The split of `budget` giving the KV cache `kv_fraction` of it or `kv_bytes` (at most one), or None without
    a budget (then neither may be given). Out-of-range shares are errors naming the value."""
    if kv_fraction is not None and kv_bytes is not None:
        raise InputError("give at most one of kv_fraction and kv_bytes")
    if budget is None:
        if kv_fraction is not None or kv_bytes is not None:
            raise InputError("kv_fraction needs device_budget_bytes: the budget it is a fraction of")
        return None
    budget = int(budget)
    if kv_fraction is not None:
        if not 0.0 <= kv_fraction <= 1.0:
            raise InputError(f"kv_fraction must be in [0, 1], got {kv_fraction}")
        kv_bytes = int(kv_fraction * budget)
    if kv_bytes is not None and not 0 <= kv_bytes <= budget:
        raise InputError(f"kv_bytes must be in [0, {budget}], got {kv_bytes}")
    return MemorySplit(budget, kv_bytes)
