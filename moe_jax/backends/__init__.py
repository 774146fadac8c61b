"""Expert placements. Each builds, per MoE layer, a module (x_td, ids_tk, weights_tk) -> y_td
(moe_jax/backends/placements.py):

device   all experts in accelerator memory (pure JAX, `ragged_dot`): the reference
host     experts on the host CPU through host_kernels (co-compute)
offload  experts in pinned host memory, the routed ones copied to the device per layer
hybrid   the experts `device_experts` names on the device, the rest on the host, both at once
auto     hybrid layers whose device cache follows the routing and whose planner places every expert per call
         (cache, stream or host) from the probe profile; plain host layers where the cost model predicts no gain
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
