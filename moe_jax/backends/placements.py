"""The expert placements as classes behind one interface (`ExpertPlacement`): each builds every MoE layer's expert
module, says how much device memory its experts hold, fits them into a new budget, and hands over its metrics.
`make_placement(name, ...)` (moe_jax/backends/__init__.py) picks the class; nothing else compares the name.

`device_budget_bytes` is the device memory a placement may hold expert weights in: the offload rounds, the
hybrid backend's device experts, or auto's stream buffers and cache. `Model.set_memory_split` moves it at run time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from host_kernels import GLU, ExpertCompute, ExpertStore, HostMoE, trim_heap
from moe_jax.backends import calibrate as layer_calibration
from moe_jax.backends.host import HostExperts
from moe_jax.backends.host_runtime import HostRuntime
from moe_jax.backends.hybrid import HybridExperts
from moe_jax.backends.metrics import BackendMetrics, MetricsRecorder
from moe_jax.backends.offload import OffloadExperts, OffloadSpec, TransferCounter
from moe_jax.distributed import ExpertShard
from moe_jax.errors import InputError, is_int
from moe_jax.formats.checkpoint import Checkpoint
from moe_jax.model.moe import DeviceExperts
from moe_jax.planning.auto_choice import AutoChoice, choose_auto
from moe_jax.planning.cost_model import Profile
from moe_jax.planning.expert_cache import ExpertCache
from moe_jax.planning.model_shape import model_shape, step_shape
from moe_jax.planning.plan import ExecutionPlan, host_store_dtype


@dataclasses.dataclass(frozen=True)
class PlacementOptions:
    """What load_model passes every placement; each reads the fields it needs."""

    host_threads: int | None = None
    device_budget_bytes: int | None = None  # None: the placement's default
    device_experts: dict | None = None  # hybrid: {layer: [expert ids]} on the device
    profile: Profile | None = None  # auto: the probe profile
    calibrate: bool = True  # auto: check the profile's verdict on one real layer (backends/calibrate.py)
    expert_shard: ExpertShard | None = None  # host: the experts this process holds (expert parallel)


class ExpertPlacement:
    """Where the experts of every MoE layer live and compute. The base holds what all share; subclasses override
    `experts_for_layer` and, where they keep experts on the device, the memory methods."""

    name = ""
    host_engine = False  # runs experts in host_kernels (the plan then holds their kernel choice)
    needs_profile = False  # reads a probe profile (PlacementOptions.profile)
    expert_shard: ExpertShard | None = None  # expert parallel: the shard of the experts this process holds
    quantized_experts = False  # runs quantized experts (all on the host: none of them is copied to the device)

    def __init__(self, checkpoint: Checkpoint, dtype, plan: ExecutionPlan, options: PlacementOptions):
        self.checkpoint = checkpoint
        self.dtype = np.dtype(dtype)
        self.plan = plan
        self.options = options
        self.metrics = MetricsRecorder()
        self.runtime: HostRuntime | None = None
        self.expert_cache: ExpertCache | None = None
        config = checkpoint.config
        self.expert_bytes = 3 * config.hidden_size * config.expert_intermediate_size * self.dtype.itemsize
        self.total_expert_bytes = self.expert_bytes * config.num_experts * len(config.moe_layers)

    def experts_for_layer(self, layer: int):
        raise NotImplementedError

    def prepare(self, transformer, training: bool = False):
        """The placement's work once its modules exist, before any step is traced: the native calls' packing
        (`HostRuntime.prepare_native_calls`); auto adds its calibration. With `training`: what a training step
        reads besides (the fused backward's layers)."""
        if self.runtime is not None:
            self.runtime.prepare_native_calls(training)

    def _expert_function(self, layer: int) -> tuple[GLU, object]:
        """(the experts' activation, the layer's experts' gate/up biases on the device in the model's dtype or
        None): what a device-side expert module computes besides its weights (GPT-OSS's)."""
        b13 = self.checkpoint.expert_gate_up_bias(layer)
        return self.checkpoint.config.expert_glu, None if b13 is None else jnp.asarray(b13, self.dtype)

    def describe(self) -> str:
        """The placement in a line."""
        return self.name

    @property
    def cache_in_use(self) -> bool:
        """Whether a device expert cache is read by some call shape (auto); else refreshes are skipped."""
        return False

    @property
    def stream_buffer_bytes(self) -> int:
        """Device memory streamed experts' double-buffered rounds take while a layer runs (auto)."""
        return 0

    def device_expert_bytes(self, transformer) -> int:
        """Expert weight bytes this placement holds (or, for streams, may hold) in device memory now."""
        return 0

    def set_expert_budget(self, budget_bytes: int, transformer):
        """Fits the expert side into `budget_bytes` of device memory, changing `transformer`'s modules; a
        placement that cannot shrink refuses a budget below what it holds."""
        needed = self.device_expert_bytes(transformer)
        if needed > budget_bytes:
            raise InputError(
                f"the {self.name} placement holds {needed} bytes of experts on the device; a split leaving "
                f"{budget_bytes} bytes for them does not fit"
            )

    def refresh_expert_cache(self, transformer) -> bool:
        """auto: moves the device cache toward the routing seen since the last call; others have none."""
        return False

    def take_metrics(self) -> BackendMetrics:
        if self.runtime is not None:
            self.runtime.fold_host_metrics()
        return self.metrics.take()

    def take_error(self) -> BaseException | None:
        if self.runtime is None:
            return None
        error, self.runtime.error = self.runtime.error, None
        return error or self.runtime.take_stream_error()


class DevicePlacement(ExpertPlacement):
    """All experts in device memory, `ragged_dot`: the pure-JAX reference."""

    name = "device"

    def experts_for_layer(self, layer: int):
        stacked = self.checkpoint.layer_experts(layer, self.dtype)
        glu, b13 = self._expert_function(layer)
        return DeviceExperts(jnp.asarray(stacked.w13), jnp.asarray(stacked.w2), glu, b13)

    def device_expert_bytes(self, transformer) -> int:
        return self.total_expert_bytes


class OffloadPlacement(ExpertPlacement):
    """Experts in pinned host memory; each layer copies its routed ones to the device in double-buffered rounds
    of `offload_slots` experts (default: two top-k sets)."""

    name = "offload"

    def __init__(self, checkpoint, dtype, plan, options):
        super().__init__(checkpoint, dtype, plan, options)
        budget = options.device_budget_bytes
        if budget is None:
            budget = 2 * checkpoint.config.num_experts_per_tok * self.expert_bytes
        self.offload_slots = max(1, budget // (2 * self.expert_bytes))

    def experts_for_layer(self, layer: int):
        stacked = self.checkpoint.layer_experts(layer, self.dtype)
        counter = TransferCounter(self.metrics, self.expert_bytes)
        glu, b13 = self._expert_function(layer)
        return OffloadExperts(stacked.w13, stacked.w2, layer, self.offload_slots, counter, glu, b13)

    def device_expert_bytes(self, transformer) -> int:
        return 2 * self.offload_slots * self.expert_bytes

    def set_expert_budget(self, budget_bytes: int, transformer):
        slots = budget_bytes // (2 * self.expert_bytes)
        if slots < 1:
            raise InputError(
                f"offload needs device room for 2 experts ({2 * self.expert_bytes} bytes); got {budget_bytes}"
            )
        self.offload_slots = slots
        for module in _modules(transformer, OffloadExperts):
            module.spec = dataclasses.replace(module.spec, slots=min(slots, len(module.w13)))


class HostPlacement(ExpertPlacement):
    """Experts on the host CPU, computed by host_kernels next to their weights (co-compute)."""

    name = "host"
    host_engine = True
    quantized_experts = True

    def __init__(self, checkpoint, dtype, plan, options):
        super().__init__(checkpoint, dtype, plan, options)
        self.expert_shard = options.expert_shard
        experts = self.expert_shard.experts(checkpoint.config.num_experts) if self.expert_shard else None
        config = checkpoint.config
        biases = {i: checkpoint.expert_gate_up_bias(i, experts) for i in config.moe_layers if config.expert_bias}
        engine = HostMoE(
            self._host_store(experts),
            threads=options.host_threads,
            kernels=plan.host_kernels,
            glu=config.expert_glu,
            gate_up_bias=biases,
        )
        self.runtime = HostRuntime(
            ExpertCompute(engine), self.metrics, host_call=plan.host_call, stream_signal=plan.stream_signal
        )
        self.experts_per_shard = len(experts) if experts else None

    def _host_store(self, experts: range | None) -> ExpertStore:
        """The converted store as mapped, or a Hugging Face directory's experts stacked once in host RAM; where the
        plan's experts are quantized and the store is not, each layer quantized as it is read (no float copy
        kept). With `experts` (expert parallel), only those of every layer."""
        store, quant = self.checkpoint.expert_store, self.plan.quant
        if store is not None and store.quant == quant:
            return store if experts is None or self.checkpoint.store_experts == experts else store.shard(experts)
        storage = host_store_dtype(self.checkpoint, self.dtype.name)
        layers = {}
        for i in tqdm(self.checkpoint.config.moe_layers, desc=f"packing experts as {quant}", disable=not quant):
            if quant:
                layers[i], _ = self.checkpoint.quantized_layer(i, quant, storage, experts)
                if store is not None:
                    store.release_pages(i)  # a converted float store's pages: read once, not needed again
                trim_heap()  # the float layer and the quantization's temporaries
            else:
                layers[i] = self.checkpoint.layer_experts(i, storage, experts)
        return ExpertStore(layers, dtype=storage)

    def experts_for_layer(self, layer: int):
        return HostExperts(self.runtime, layer, self.experts_per_shard)

    def _device_layer(self, layer: int):
        """The layer's experts in the model's dtype, as a device cache and the streams hold them."""
        store_layer = self.runtime.compute.store[layer]
        if store_layer.w13.dtype == self.dtype:
            return store_layer
        return self.checkpoint.layer_experts(layer, self.dtype)

    def device_expert_bytes(self, transformer) -> int:
        return sum(m.cache_bytes for m in hybrid_layers(transformer)) + self.stream_buffer_bytes


class HybridPlacement(HostPlacement):
    """The experts `device_experts` names ({layer: [ids]}) on the device, the rest on the host, both at once."""

    name = "hybrid"
    quantized_experts = False  # its device share reads the float weights

    def __init__(self, checkpoint, dtype, plan, options):
        super().__init__(checkpoint, dtype, plan, options)
        self.device_experts = _check_device_experts(options.device_experts or {}, checkpoint.config)

    def experts_for_layer(self, layer: int):
        glu, b13 = self._expert_function(layer)
        cached = self.device_experts.get(layer, ())
        return HybridExperts(self.runtime, layer, self._device_layer(layer), cached, glu=glu, b13_ef2=b13)


class AutoPlacement(HostPlacement):
    """Hybrid layers whose device cache follows the routing (moe_jax.planning.expert_cache) and whose planner places
    every expert per call (cache, stream or host) from the probe profile; plain host layers where the cost model
    predicts no gain worth the device (moe_jax.planning.auto_choice). By default it takes half the free device memory
    (where the device reports it), else a quarter of the experts."""

    name = "auto"
    needs_profile = True
    quantized_experts = False  # a device cache would read the float weights

    def __init__(self, checkpoint, dtype, plan, options):
        super().__init__(checkpoint, dtype, plan, options)
        budget = options.device_budget_bytes
        if budget is None:
            budget = _free_device_bytes() // 2 or self.total_expert_bytes // 4
        self.profile = options.profile
        self.host_phases: frozenset[int] | None = None  # phases measured faster on the host path
        self.calibration: dict[int, tuple] = {}  # phase -> (host, device) seconds of one layer call
        config = checkpoint.config
        helps = self.profile is not None and self.profile.device_helps
        self.stream_slots = _stream_slots(budget, self.expert_bytes, config.num_experts_per_tok) if helps else 0
        self.expert_cache = ExpertCache(
            config.moe_layers, config.num_experts, self.expert_bytes, max(0, budget - self.stream_buffer_bytes)
        )
        step = step_shape(config, self.dtype.itemsize)  # host layers' whole steps, in the device/host pipeline
        self.auto_choice: AutoChoice = choose_auto(
            self.profile, step.experts, self.expert_cache.capacity, self.stream_slots > 0, step=step
        )
        self.uses_device = self.auto_choice.use_device  # a device cache and streams (else host layers alone)
        if not self.uses_device:
            self.stream_slots = 0
            self.expert_cache.set_budget(0)

    def describe(self) -> str:
        """What auto chose and why, with the load-time measurements."""
        measured = "; ".join(
            f"{tokens} tokens measured host {host * 1e3:.2f} ms, device path {device * 1e3:.2f} ms"
            + (" (host path used)" if tokens in (self.host_phases or ()) else "")
            for tokens, (host, device) in sorted(self.calibration.items())
        )
        return f"auto: {self.auto_choice.summary()}" + (f"; {measured}" if measured else "")

    @property
    def cache_in_use(self) -> bool:
        if self.expert_cache.capacity == 0:
            return False
        if self.host_phases is None or not self.calibration:  # not built yet, or not calibrated: trust the plan
            return True
        return any(t not in self.host_phases for t in self.calibration)

    @property
    def stream_buffer_bytes(self) -> int:
        return 2 * self.stream_slots * self.expert_bytes

    def experts_for_layer(self, layer: int):
        if not self.uses_device:
            return HostExperts(self.runtime, layer)
        stream = None
        if self.stream_slots:
            stream = OffloadSpec(layer, self.stream_slots, 0.0, TransferCounter(self.metrics, self.expert_bytes))
        capacity = self.expert_cache.capacity
        # until routing has been seen, the cache holds the lowest expert ids (all of them when they fit)
        first = range(capacity)
        shape = model_shape(self.checkpoint.config, self.dtype.itemsize)
        glu, b13 = self._expert_function(layer)
        return HybridExperts(
            self.runtime, layer, self._device_layer(layer), first, capacity, self.profile, stream, shape, glu, b13
        )

    def prepare(self, transformer, training: bool = False):
        """Also, at load: checks the cost model's predictions on the first layer (`calibrate`), once, and gives
        every layer the phases the host path measured faster in."""
        super().prepare(transformer, training)
        layers = hybrid_layers(transformer)
        if self.host_phases is not None or not layers:
            return
        calibrate = self.options.calibrate
        measured = layer_calibration.host_faster_phases(layers[0], self.dtype) if calibrate else (frozenset(), {})
        self.host_phases, self.calibration = measured
        for module in layers:
            module.spec = dataclasses.replace(module.spec, host_phases=self.host_phases)

    def set_expert_budget(self, budget_bytes: int, transformer):
        if budget_bytes < self.stream_buffer_bytes:
            raise InputError(
                f"auto keeps {self.stream_buffer_bytes} bytes of stream buffers on the device; a split leaving "
                f"{budget_bytes} bytes for experts does not fit"
            )
        cache = self.expert_cache
        cache.set_budget(budget_bytes - self.stream_buffer_bytes if self.uses_device else 0)
        for module in hybrid_layers(transformer):
            if module.spec.capacity != cache.capacity:
                hottest = sorted(module.cached, key=lambda e: -cache.heat[module.spec.layer][e])
                fill = hottest + [e for e in cache.target(module.spec.layer) if e not in hottest]
                module.resize(cache.capacity, fill[: cache.capacity])

    def refresh_expert_cache(self, transformer) -> bool:
        """Folds the routing seen since the last call into the cache policy and moves the device cache toward it
        (bounded churn). Returns whether any layer's cache changed."""
        self.runtime.fold_host_metrics()  # brings in the pairs the native forward counted
        self.expert_cache.observe(self.runtime.routing.take())
        changed = False
        for module in hybrid_layers(transformer):
            chosen = self.expert_cache.choose(module.spec.layer, module.cached)
            if chosen != module.cached:
                module.set_cached(chosen)
                changed = True
        return changed


PLACEMENTS = {
    cls.name: cls for cls in (DevicePlacement, HostPlacement, OffloadPlacement, HybridPlacement, AutoPlacement)
}


def _stream_slots(budget: int, expert_bytes: int, top_k: int) -> int:
    """auto streams rounds of up to top-k experts, double-buffered, when the budget has room for them."""
    return int(min(top_k, budget // (4 * expert_bytes)))  # at most half the budget for stream buffers


def _free_device_bytes() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return max(0, int(stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0)))


def _modules(transformer, kind) -> list:
    return [m for _, m in nnx.iter_graph(transformer) if isinstance(m, kind)]


def hybrid_layers(transformer) -> list[HybridExperts]:
    """The hybrid / auto expert modules of a model (their device caches)."""
    return _modules(transformer, HybridExperts)


def check_device_experts_flag(backend: str, experts_file) -> None:
    """The CLIs' rule: hybrid takes the experts to keep on the device (without them it would be the host backend
    under another name), and only hybrid does."""
    if backend == "hybrid" and not experts_file:
        raise InputError(
            'the hybrid backend needs the experts it keeps on the device: --device-experts FILE (JSON {"layer": '
            "[expert ids]}; `python -m moe_jax.advise` suggests placements), or use --backend auto"
        )
    if experts_file and backend != "hybrid":
        raise InputError(f"--device-experts is for --backend hybrid, not {backend!r}")


def read_device_experts(path) -> dict[int, list[int]]:
    """The hybrid backend's device experts from a JSON file `{"layer": [expert ids], ...}` (what
    `--device-experts` takes; `moe_jax.planning.advise` and `HybridPlacement` use the same form). Checked for form
    here, against the model at load."""
    path = Path(path)
    try:
        experts_by_layer = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such device experts file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(experts_by_layer, dict) or not experts_by_layer:
        raise InputError(f'{path}: the device experts are a non-empty JSON object {{"layer": [expert ids]}}')
    checked = {}
    for layer, experts in experts_by_layer.items():
        if not layer.isdigit():
            raise InputError(f"{path}: {layer!r} is not a layer number")
        if not isinstance(experts, list) or not all(is_int(e) for e in experts):
            raise InputError(f"{path}: layer {layer}: expected a list of expert ids, got {experts!r}")
        checked[int(layer)] = experts
    return checked


def _check_device_experts(experts_by_layer: dict, config) -> dict[int, tuple[int, ...]]:
    checked = {}
    for layer, experts in experts_by_layer.items():
        if int(layer) not in config.moe_layers:
            raise InputError(f"device_experts names layer {layer}, which is not an MoE layer ({config.moe_layers})")
        bad = [e for e in experts if not 0 <= int(e) < config.num_experts]
        if bad:
            raise InputError(f"device_experts for layer {layer}: expert ids {bad} outside [0, {config.num_experts})")
        checked[int(layer)] = tuple(sorted({int(e) for e in experts}))
    return checked
