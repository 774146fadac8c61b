"""Expert placements: device, host, offload, hybrid and auto. Each builds, per MoE layer, a module (x_td, ids_tk,
weights_tk) -> y_td (moe_jax/backends/placements.py); `make_placement` picks the class by name.

How it works and why: docs/INTERNALS.md, moe_jax/backends/__init__.py.
"""

from __future__ import annotations

from moe_jax.backends.placements import PLACEMENTS, ExpertPlacement, PlacementOptions
from moe_jax.formats.checkpoint import Checkpoint
from moe_jax.planning.plan import ExecutionPlan

BACKENDS = tuple(PLACEMENTS)


def make_placement(
    name: str, checkpoint: Checkpoint, dtype, plan: ExecutionPlan, options: PlacementOptions
) -> ExpertPlacement:
    """The placement called `name` (one of BACKENDS) for this checkpoint, dtype and execution plan."""
    return PLACEMENTS[name](checkpoint, dtype, plan, options)


__all__ = ["BACKENDS", "PLACEMENTS", "ExpertPlacement", "PlacementOptions", "make_placement"]
