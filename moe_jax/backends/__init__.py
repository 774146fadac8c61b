"""Expert placements. Each backend builds, per MoE layer, a callable (x_td, ids_tk, weights_tk) -> y_td.

device   all experts in accelerator memory (pure JAX, `ragged_dot`): the reference
host     experts on the host CPU through host_kernels callbacks (co-compute)
offload  experts in pinned host memory, the routed ones copied to the device per layer
hybrid   a placement plan: some experts on the device, the rest on the host, both at once
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from host_kernels.engine import HostMoE
from host_kernels.store import ExpertStore
from moe_jax.backends.host import HostExperts, HostRuntime
from moe_jax.backends.hybrid import HybridExperts
from moe_jax.backends.metrics import BackendMetrics, MetricsRecorder
from moe_jax.backends.offload import OffloadExperts, TransferCounter
from moe_jax.checkpoint import Checkpoint
from moe_jax.errors import InputError
from moe_jax.moe import DeviceExperts

BACKENDS = ("device", "host", "offload", "hybrid")


class Backend:
    """Builds every layer's expert module for one placement and holds the host runtime (if any)."""

    def __init__(
        self,
        name: str,
        checkpoint: Checkpoint,
        dtype,
        host_threads: int | None = None,
        device_budget_bytes: int | None = None,
        placement_plan: dict[int, list[int]] | None = None,
    ):
        self.name = name
        self.checkpoint = checkpoint
        self.dtype = np.dtype(dtype)
        self.metrics = MetricsRecorder()
        self.runtime: HostRuntime | None = None
        config = checkpoint.config
        self.expert_bytes = 3 * config.hidden_size * config.expert_intermediate_size * self.dtype.itemsize
        # offload keeps two rounds of `slots` experts on the device (double buffer); default: two top-k sets
        budget = device_budget_bytes or 2 * config.num_experts_per_tok * self.expert_bytes
        self.offload_slots = max(1, budget // (2 * self.expert_bytes))
        self.plan = _check_plan(placement_plan or {}, config) if name == "hybrid" else {}
        if name in ("host", "hybrid"):
            self.runtime = HostRuntime(HostMoE(self._host_store(), threads=host_threads), self.metrics)

    def _host_store(self) -> ExpertStore:
        """The converted store as mapped, or a Hugging Face directory's experts stacked once in host RAM."""
        if self.checkpoint.expert_store is not None:
            return self.checkpoint.expert_store
        storage = self.dtype if self.dtype == np.dtype(jnp.bfloat16) else np.dtype(np.float32)
        return ExpertStore({i: self.checkpoint.layer_experts(i, storage) for i in self.checkpoint.config.moe_layers})

    def experts_for_layer(self, layer: int):
        if self.name == "host":
            return HostExperts(self.runtime, layer)
        if self.name == "hybrid":
            return HybridExperts(self.runtime, layer, self.runtime.engine.store[layer], self.plan.get(layer, ()))
        stacked = self.checkpoint.layer_experts(layer, self.dtype)
        if self.name == "offload":
            counter = TransferCounter(self.metrics, self.expert_bytes)
            return OffloadExperts(stacked.w13, stacked.w2, layer, self.offload_slots, counter)
        return DeviceExperts(jnp.asarray(stacked.w13), jnp.asarray(stacked.w2))

    def take_metrics(self) -> BackendMetrics:
        return self.metrics.take()

    def take_error(self) -> BaseException | None:
        if self.runtime is None:
            return None
        error, self.runtime.error = self.runtime.error, None
        return error


def _check_plan(plan: dict, config) -> dict[int, tuple[int, ...]]:
    checked = {}
    for layer, experts in plan.items():
        if int(layer) not in config.moe_layers:
            raise InputError(f"placement plan names layer {layer}, which is not an MoE layer ({config.moe_layers})")
        bad = [e for e in experts if not 0 <= int(e) < config.num_experts]
        if bad:
            raise InputError(f"placement plan for layer {layer}: expert ids {bad} outside [0, {config.num_experts})")
        checked[int(layer)] = tuple(sorted({int(e) for e in experts}))
    return checked
