"""Per-expert LoRA adapters for one layer's routed experts, as the host kernels take and return them.

For projection p in gate/up/down with base weight W_e [in, out]: W_e + scale * A_e @ B_e, with
A [experts, in, rank] and B [experts, rank, out]. Any subset of the three projections may be adapted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_kernels.errors import HostKernelError

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertLoRA:
    scale: float
    gate: tuple[np.ndarray, np.ndarray] | None = None  # A [e, d, r], B [e, r, f]
    up: tuple[np.ndarray, np.ndarray] | None = None  # A [e, d, r], B [e, r, f]
    down: tuple[np.ndarray, np.ndarray] | None = None  # A [e, f, r], B [e, r, d]

    def validate(self, layer: int, experts: int, hidden: int, ffn: int):
        dims = {"gate": (hidden, ffn), "up": (hidden, ffn), "down": (ffn, hidden)}
        for name in PROJECTIONS:
            pair = getattr(self, name)
            if pair is None:
                continue
            a, b = pair
            fan_in, fan_out = dims[name]
            rank = a.shape[-1] if a.ndim == 3 else -1
            if a.shape != (experts, fan_in, rank) or b.shape != (experts, rank, fan_out):
                raise HostKernelError(
                    f"layer {layer}: LoRA {name} has A {a.shape} and B {b.shape}, expected "
                    f"A ({experts}, {fan_in}, r) and B ({experts}, r, {fan_out})"
                )
            if a.dtype != np.float32 or b.dtype != np.float32:
                raise HostKernelError(f"layer {layer}: LoRA {name} must be float32, got {a.dtype}/{b.dtype}")

    def zeros_like(self) -> ExpertLoRA:
        def z(pair):
            return None if pair is None else (np.zeros_like(pair[0]), np.zeros_like(pair[1]))

        return ExpertLoRA(self.scale, z(self.gate), z(self.up), z(self.down))
