"""Expert placements. Each backend builds, per MoE layer, a callable (x_td, ids_tk, weights_tk) -> y_td.

device   all experts in accelerator memory (pure JAX, `ragged_dot`): the reference
host     experts on the host CPU through host_kernels callbacks (co-compute)
offload  experts in pinned host memory, the routed ones copied to the device per layer
hybrid   a placement plan: some experts on the device, the rest on the host, both at once
auto     hybrid layers whose device cache follows the routing (moe_jax.expert_cache) and whose planner places
         every expert per call (cache, stream or host) from the probe profile; plain host layers where the cost
         model predicts no gain worth the device (moe_jax.auto_choice)

`device_budget_bytes` is the device memory this placement may hold expert weights in: the offload rounds, the
hybrid plan, or auto's stream buffers and cache. `Model.set_memory_split` moves it at run time.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from host_kernels import ExpertStore, HostMoE
from moe_jax.auto_choice import AutoChoice, choose_auto, model_shape
from moe_jax.backends import calibrate as layer_calibration
from moe_jax.backends.host import HostExperts, HostRuntime
from moe_jax.backends.hybrid import HybridExperts
from moe_jax.backends.metrics import BackendMetrics, MetricsRecorder
from moe_jax.backends.offload import OffloadExperts, OffloadSpec, TransferCounter
from moe_jax.checkpoint import Checkpoint
from moe_jax.cost_model import Profile
from moe_jax.errors import InputError
from moe_jax.expert_cache import ExpertCache
from moe_jax.moe import DeviceExperts
from moe_jax.plan import ExecutionPlan, host_store_dtype

BACKENDS = ("device", "host", "offload", "hybrid", "auto")


class Backend:
    """Builds every layer's expert module for one placement and holds the host runtime (if any)."""

    def __init__(
        self,
        name: str,
        checkpoint: Checkpoint,
        dtype,
        plan: ExecutionPlan,
        host_threads: int | None = None,
        device_budget_bytes: int | None = None,
        placement_plan: dict[int, list[int]] | None = None,
        profile: Profile | None = None,
        calibrate: bool = True,
    ):
        self.name = name
        self.checkpoint = checkpoint
        self.dtype = np.dtype(dtype)
        self.metrics = MetricsRecorder()
        self.runtime: HostRuntime | None = None
        config = checkpoint.config
        self.expert_bytes = 3 * config.hidden_size * config.expert_intermediate_size * self.dtype.itemsize
        self.total_expert_bytes = self.expert_bytes * config.num_experts * len(config.moe_layers)
        # offload keeps two rounds of `slots` experts on the device (double buffer); default: two top-k sets.
        # auto by default takes half the free device memory (where the device reports it), else a quarter of
        # the experts
        if device_budget_bytes is None:
            if name == "auto":
                device_budget_bytes = _free_device_bytes() // 2 or self.total_expert_bytes // 4
            else:
                device_budget_bytes = 2 * config.num_experts_per_tok * self.expert_bytes
        budget = device_budget_bytes
        self.offload_slots = max(1, budget // (2 * self.expert_bytes))
        self.plan = _check_plan(placement_plan or {}, config) if name == "hybrid" else {}
        self.profile = profile
        self.calibrate = calibrate  # auto: check the profile's verdict on one real layer (backends.calibrate)
        self.expert_cache: ExpertCache | None = None
        self.auto_choice: AutoChoice | None = None
        self.uses_device = False  # auto: a device cache and streams, planned per call (else host layers alone)
        self.host_phases: frozenset[int] | None = None  # auto: phases measured faster on the host path
        self.calibration: dict[int, tuple] = {}  # phase -> (host, device) seconds of one layer call
        if name == "auto":
            self._choose_auto(budget)
        if name in ("host", "hybrid", "auto"):
            engine = HostMoE(self._host_store(), threads=host_threads, kernels=plan.host_kernels)
            self.runtime = HostRuntime(engine, self.metrics, experts_ffi=plan.experts_ffi)

    def _choose_auto(self, budget: int):
        """auto: stream buffers and a cache in `budget` where the shared rule (moe_jax.auto_choice) predicts they
        pay in some phase; else no cache, no streams: host layers alone, as fast as backend="host"."""
        config = self.checkpoint.config
        helps = self.profile is not None and self.profile.device_helps
        self.stream_slots = _stream_slots(budget, self.expert_bytes, config.num_experts_per_tok) if helps else 0
        self.expert_cache = ExpertCache(
            config.moe_layers, config.num_experts, self.expert_bytes, max(0, budget - self.stream_buffer_bytes)
        )
        shape = model_shape(config, self.dtype.itemsize)
        self.auto_choice = choose_auto(self.profile, shape, self.expert_cache.capacity, self.stream_slots > 0)
        self.uses_device = self.auto_choice.use_device
        if not self.uses_device:
            self.stream_slots = 0
            self.expert_cache.set_budget(0)

    def _cache_budget(self, expert_budget: int) -> int:
        return expert_budget - self.stream_buffer_bytes if self.uses_device else 0

    def describe(self) -> str:
        """The placement in a line (auto: what it chose and why)."""
        if self.auto_choice is None:
            return self.name
        measured = "; ".join(
            f"{tokens} tokens measured host {host * 1e3:.2f} ms, device path {device * 1e3:.2f} ms"
            + (" (host path used)" if tokens in (self.host_phases or ()) else "")
            for tokens, (host, device) in sorted(self.calibration.items())
        )
        return f"auto: {self.auto_choice.summary()}" + (f"; {measured}" if measured else "")

    @property
    def cache_in_use(self) -> bool:
        """auto: whether some call shape traces the device path (else the cache is never read: no refreshes)."""
        if self.expert_cache is None or self.expert_cache.capacity == 0:
            return False
        if self.host_phases is None or not self.calibration:  # not built yet, or not calibrated: trust the plan
            return True
        return any(t not in self.host_phases for t in self.calibration)

    @property
    def stream_buffer_bytes(self) -> int:
        """auto: device memory the streamed experts' double-buffered rounds take while a layer runs."""
        return 2 * self.stream_slots * self.expert_bytes if self.name == "auto" else 0

    def _host_store(self) -> ExpertStore:
        """The converted store as mapped, or a Hugging Face directory's experts stacked once in host RAM."""
        if self.checkpoint.expert_store is not None:
            return self.checkpoint.expert_store
        storage = host_store_dtype(self.checkpoint, self.dtype.name)
        return ExpertStore({i: self.checkpoint.layer_experts(i, storage) for i in self.checkpoint.config.moe_layers})

    def experts_for_layer(self, layer: int):
        if self.name == "host" or (self.name == "auto" and not self.uses_device):
            return HostExperts(self.runtime, layer)
        if self.name == "hybrid":
            return HybridExperts(self.runtime, layer, self._device_layer(layer), self.plan.get(layer, ()))
        if self.name == "auto":
            stream = None
            if self.stream_slots:
                stream = OffloadSpec(layer, self.stream_slots, 0.0, TransferCounter(self.metrics, self.expert_bytes))
            capacity = self.expert_cache.capacity
            # until routing has been seen, the cache holds the lowest expert ids (all of them when they fit)
            first = range(capacity)
            shape = model_shape(self.checkpoint.config, self.dtype.itemsize)
            module = HybridExperts(
                self.runtime, layer, self._device_layer(layer), first, capacity, self.profile, stream, shape
            )
            if self.host_phases is None:  # the first layer built: check the predictions on it, once
                measured = (
                    layer_calibration.host_faster_phases(module, self.dtype) if self.calibrate else (frozenset(), {})
                )
                self.host_phases, self.calibration = measured
            module.spec = dataclasses.replace(module.spec, host_phases=self.host_phases)
            return module
        stacked = self.checkpoint.layer_experts(layer, self.dtype)
        if self.name == "offload":
            counter = TransferCounter(self.metrics, self.expert_bytes)
            return OffloadExperts(stacked.w13, stacked.w2, layer, self.offload_slots, counter)
        return DeviceExperts(jnp.asarray(stacked.w13), jnp.asarray(stacked.w2))

    def _device_layer(self, layer: int):
        """The layer's experts in the model's dtype, as the device cache and the streams hold them."""
        store_layer = self.runtime.engine.store[layer]
        if store_layer.w13.dtype == self.dtype:
            return store_layer
        return self.checkpoint.layer_experts(layer, self.dtype)

    # ------------------------------------------------------------ device memory of the expert side
    def device_expert_bytes(self, transformer) -> int:
        """Expert weight bytes this placement holds (or, for streams, may hold) in device memory now."""
        if self.name == "device":
            return self.total_expert_bytes
        if self.name == "offload":
            return 2 * self.offload_slots * self.expert_bytes
        cached = sum(m.cache_bytes for m in _hybrid_layers(transformer))
        return cached + self.stream_buffer_bytes

    def set_expert_budget(self, budget_bytes: int, transformer):
        """Fits the expert side into `budget_bytes` of device memory, changing `transformer`'s modules."""
        if self.name == "auto":
            if budget_bytes < self.stream_buffer_bytes:
                raise InputError(
                    f"auto keeps {self.stream_buffer_bytes} bytes of stream buffers on the device; a split leaving "
                    f"{budget_bytes} bytes for experts does not fit"
                )
            self.expert_cache.set_budget(self._cache_budget(budget_bytes))
            for module in _hybrid_layers(transformer):
                cache = self.expert_cache
                if module.spec.capacity != cache.capacity:
                    hottest = sorted(module.cached, key=lambda e: -cache.heat[module.spec.layer][e])
                    fill = hottest + [e for e in cache.target(module.spec.layer) if e not in hottest]
                    module.resize(cache.capacity, fill[: cache.capacity])
            return
        if self.name == "offload":
            slots = budget_bytes // (2 * self.expert_bytes)
            if slots < 1:
                raise InputError(
                    f"offload needs device room for 2 experts ({2 * self.expert_bytes} bytes); got {budget_bytes}"
                )
            self.offload_slots = slots
            for module in _modules(transformer, OffloadExperts):
                module.spec = dataclasses.replace(module.spec, slots=min(slots, len(module.w13)))
            return
        needed = self.device_expert_bytes(transformer)
        if needed > budget_bytes:
            raise InputError(
                f"the {self.name} placement holds {needed} bytes of experts on the device; a split leaving "
                f"{budget_bytes} bytes for them does not fit"
            )

    def refresh_expert_cache(self, transformer) -> bool:
        """auto: folds the routing seen since the last call into the cache policy and moves the device cache
        toward it (bounded churn). Returns whether any layer's cache changed."""
        if self.expert_cache is None:
            return False
        self.runtime.fold_fused_metrics()  # brings in the pairs the native forward counted
        self.expert_cache.observe(self.runtime.routing.take())
        changed = False
        for module in _hybrid_layers(transformer):
            chosen = self.expert_cache.choose(module.spec.layer, module.cached)
            if chosen != module.cached:
                module.set_cached(chosen)
                changed = True
        return changed

    def take_metrics(self) -> BackendMetrics:
        if self.runtime is not None:
            self.runtime.fold_fused_metrics()
        return self.metrics.take()

    def take_error(self) -> BaseException | None:
        if self.runtime is None:
            return None
        error, self.runtime.error = self.runtime.error, None
        return error


def _stream_slots(budget: int, expert_bytes: int, top_k: int) -> int:
    """auto streams rounds of up to top-k experts, double-buffered, when the budget has room for them."""
    return int(min(top_k, budget // (4 * expert_bytes)))  # at most half the budget for stream buffers


def _free_device_bytes() -> int:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return max(0, int(stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0)))


def _modules(transformer, kind) -> list:
    return [m for _, m in nnx.iter_graph(transformer) if isinstance(m, kind)]


def _hybrid_layers(transformer) -> list[HybridExperts]:
    return _modules(transformer, HybridExperts)


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
