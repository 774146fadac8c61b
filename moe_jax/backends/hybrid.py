"""backend="hybrid" and "auto": each layer's experts split between a device cache, the bus and the host.

How it works and why: docs/INTERNALS.md, moe_jax/backends/hybrid.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from host_kernels import GLU, NOT_ROUTED, SWIGLU
from moe_jax.backends.expert_vjp import expert_function, gradient_shapes
from moe_jax.backends.host import HostLayer, host_experts
from moe_jax.backends.host_runtime import HostRuntime
from moe_jax.backends.offload import (
    OffloadSpec,
    SpecExperts,
    pinned_expert_buffers,
    streamed_backward,
    streamed_forward,
)
from moe_jax.model.layers import Frozen, lora_arrays
from moe_jax.model.moe import subset_experts
from moe_jax.planning.auto_choice import nearest_phase
from moe_jax.planning.cost_model import Profile, best_placement
from moe_jax.planning.model_shape import Shape


class CacheSlot(nnx.Variable):
    """Device expert cache contents: weights of the cached experts and which expert each slot holds."""


@dataclass(frozen=True, eq=False)  # hashed by identity: a static custom_vjp argument holding arrays
class HybridSpec:
    runtime: HostRuntime
    layer: int
    store: object  # this layer's host store arrays (LayerExperts): the source of cache fills and streams
    capacity: int
    lora_scale: float
    profile: Profile | None = None  # with a profile, a planner places every expert per call (cached ones too)
    stream: OffloadSpec | None = None  # ... and may stream uncached ones over the bus
    shape: Shape | None = None  # with a profile: the model's expert shape, for the per-call-shape rule below
    host_phases: frozenset[int] = frozenset()  # phases where the host path measured faster (backends.calibrate)
    glu: GLU = SWIGLU  # the experts' activation on the device side (the host engine holds its own)

    def device_pays(self, tokens: int) -> bool:
        """Whether calls of `tokens` tokens trace the planner and the device path at all: not where one real
        layer measured the host backend's path at least as fast at the nearest phase (backends.calibrate); those
        calls trace the host backend's path, and are exactly as fast."""
        return self.profile is None or nearest_phase(tokens) not in self.host_phases

    @property
    def num_experts(self) -> int:
        return self.store.num_experts

    @property
    def host_needed(self) -> bool:
        return self.capacity < self.num_experts or self.profile is not None


@dataclass(frozen=True)
class CallPlacement:
    """Where one call's experts compute: `on_device` [e] (from the cache or streamed; the host takes the rest),
    the cache slots in use (`cache_ids` with unused slots emptied), the streamed rounds [r, slots] (None: no
    streams) and how many experts are streamed."""

    on_device: jax.Array
    counts: jax.Array
    cache_ids: jax.Array
    rounds: jax.Array | None
    streamed: jax.Array | int


def _placement(spec: HybridSpec, ids_tk, cache_ids) -> CallPlacement:
    e = spec.num_experts
    resident = jnp.zeros(e + 1, bool).at[cache_ids].set(True)[:e]
    counts = jnp.bincount(ids_tk.reshape(-1), length=e)
    if spec.profile is None:  # a static plan (backend="hybrid"): the cached experts always compute there
        return CallPlacement(resident, counts, cache_ids, None, 0)
    k, order = best_placement(spec.profile, counts, resident, spec.stream is not None, xp=jnp)
    on_device = jnp.zeros(e, bool).at[order].set(jnp.arange(e) < k)
    cached_used = jnp.where(on_device[jnp.minimum(cache_ids, e - 1)] & (cache_ids < e), cache_ids, e)
    if spec.stream is None:
        return CallPlacement(on_device, counts, cached_used, None, 0)
    to_stream = (on_device & ~resident)[order]
    count = jnp.sum(to_stream)
    packed = order[jnp.argsort(~to_stream, stable=True)]  # the streamed experts first, in the ranking's order
    streamed = jnp.where(jnp.arange(e) < count, packed, e).astype(jnp.int32)
    slots = spec.stream.slots
    rounds = jnp.concatenate([streamed, jnp.full(-e % slots, e, jnp.int32)]).reshape(-1, slots)
    return CallPlacement(on_device, counts, cached_used, rounds, count)


def _stream_spec(spec: HybridSpec) -> OffloadSpec:
    return dataclasses.replace(spec.stream, lora_scale=spec.lora_scale, glu=spec.glu)


def _cached_part(spec: HybridSpec, x_td, ids_tk, weights_tk, lora, cache, cache_ids):
    w13_slots, w2_slots, _, b13 = cache
    return subset_experts(
        x_td, ids_tk, weights_tk, cache_ids, w13_slots, w2_slots, spec.num_experts, lora, spec.lora_scale, spec.glu, b13
    )


def _device_part(spec: HybridSpec, x_td, ids_tk, weights_tk, lora, cache, streaming, placement: CallPlacement):
    y = jnp.zeros_like(x_td)
    if spec.capacity:  # slots emptied for this call (their rows go to the host) cost a skipped cond each
        y = y + _cached_part(spec, x_td, ids_tk, weights_tk, lora, cache, placement.cache_ids)
    if placement.rounds is not None:
        stream_spec = _stream_spec(spec)
        y = y + jax.lax.cond(
            placement.streamed > 0,
            lambda: streamed_forward(
                stream_spec, x_td, ids_tk, weights_tk, lora, *streaming, placement.rounds, cache[3]
            ),
            lambda: jnp.zeros_like(x_td),
        )
    return y


def _overlapped(spec: HybridSpec, method: str, counts, host_args: tuple, result_shapes, device_fn, device_inputs):
    """Submits the host call, runs `device_fn(*device_inputs)` meanwhile, then collects the host result."""
    if not spec.host_needed:
        return None, device_fn(*device_inputs)

    def submit(counts, *args):
        if counts is not None:
            spec.runtime.routing.add(spec.layer, counts)
        return spec.runtime.submit(method, spec.layer, spec.lora_scale, *args)

    # pure_callback, not io_callback: data dependencies (ticket, probe) already order the two, and an io_callback
    # with results costs time every step even in a branch not taken (XLA:CPU)
    ticket = jax.pure_callback(submit, jax.ShapeDtypeStruct((), jnp.int32), counts, *host_args)
    ticket, device_inputs = jax.lax.optimization_barrier((ticket, device_inputs))
    device_out = device_fn(*device_inputs)
    probe = jax.tree.leaves(device_out)[0].reshape(-1)[:1]
    host_out = jax.pure_callback(lambda t, _: spec.runtime.collect(t), result_shapes, ticket, probe)
    return host_out, device_out


def _host_ids(on_device, ids_tk):
    return jnp.where(on_device[ids_tk], NOT_ROUTED, ids_tk)


def host_path(spec: HybridSpec, x_td, ids_tk, weights_tk, lora):
    """The host backend's own call for this layer (through XLA's FFI where it can): no planner, no callbacks."""
    return host_experts(HostLayer(spec.runtime, spec.layer, spec.lora_scale), x_td, ids_tk, weights_tk, lora)


def _record_routing(spec: HybridSpec, device_counts):
    """Device pairs' experts into the routing the expert cache learns from (host pairs are counted where the
    host computes them: see HostRuntime.fold_host_metrics)."""
    io_callback(lambda counts: spec.runtime.routing.add(spec.layer, counts), None, device_counts)


def _hybrid_forward(spec: HybridSpec, x_td, ids_tk, weights_tk, lora, cache, streaming):
    placement = _placement(spec, ids_tk, cache[2])
    if not spec.host_needed:
        return _device_part(spec, x_td, ids_tk, weights_tk, lora, cache, streaming, placement)
    device_counts = jnp.where(placement.on_device, placement.counts, 0)
    host_counts = placement.counts - device_counts

    def host_only():
        return host_path(spec, x_td, ids_tk, weights_tk, lora)

    def device_only():
        _record_routing(spec, device_counts)
        return _device_part(spec, x_td, ids_tk, weights_tk, lora, cache, streaming, placement)

    def both():
        host_y, device_y = _overlapped(
            spec,
            "forward",
            device_counts,
            (x_td, _host_ids(placement.on_device, ids_tk), weights_tk, lora),
            jax.ShapeDtypeStruct(x_td.shape, x_td.dtype),
            lambda x: _device_part(spec, x, ids_tk, weights_tk, lora, cache, streaming, placement),
            (x_td,),
        )
        return host_y + device_y

    branch = jnp.where(jnp.any(device_counts > 0), jnp.where(jnp.any(host_counts > 0), 2, 1), 0)
    return jax.lax.switch(branch, [host_only, device_only, both])


def _hybrid_backward(spec: HybridSpec, arguments, _kept, dy_td):
    x_td, ids_tk, weights_tk, lora, cache, streaming = arguments
    placement = _placement(spec, ids_tk, cache[2])

    def device_grads(x, weights, lora_t):
        zeros = lambda: jax.tree.map(jnp.zeros_like, (x, weights, lora_t))  # noqa: E731
        grads = zeros()
        if spec.capacity:
            cached = lambda x, w, lo: _cached_part(spec, x, ids_tk, w, lo, cache, placement.cache_ids)  # noqa: E731
            grads = jax.vjp(cached, x, weights, lora_t)[1](dy_td)
        if placement.rounds is not None:
            stream_spec = _stream_spec(spec)
            rounds = placement.rounds
            streamed = jax.lax.cond(
                placement.streamed > 0,
                lambda: streamed_backward(stream_spec, x, ids_tk, weights, lora_t, *streaming, rounds, dy_td, cache[3]),
                zeros,
            )
            grads = jax.tree.map(jnp.add, grads, streamed)
        return grads

    host_grads, device_grads_ = _overlapped(
        spec,
        "backward",
        None,
        (x_td, _host_ids(placement.on_device, ids_tk), weights_tk, lora, dy_td),
        gradient_shapes(x_td, weights_tk, lora),
        device_grads,
        (x_td, weights_tk, lora),
    )
    grads = [g for g in (host_grads, device_grads_) if g is not None]
    return jax.tree.map(lambda *parts: sum(parts), *grads)


hybrid_experts = expert_function(_hybrid_forward, _hybrid_backward)


class HybridExperts(SpecExperts):
    """One layer: a device cache of `capacity` experts (initially `cached`), the rest on the host; with a
    profile, a planner places every expert per call, and with `stream` may also stream uncached ones."""

    def __init__(
        self,
        runtime: HostRuntime,
        layer: int,
        layer_experts,
        cached,
        capacity: int | None = None,
        profile: Profile | None = None,
        stream: OffloadSpec | None = None,
        shape: Shape | None = None,
        glu: GLU = SWIGLU,
        b13_ef2=None,
    ):
        """`glu` and `b13_ef2` (every expert's gate/up biases, on the device): where the experts are not a plain
        SwiGLU without biases (GPT-OSS)."""
        capacity = len(cached) if capacity is None else capacity
        self.spec = HybridSpec(runtime, layer, layer_experts, capacity, 0.0, profile, stream, shape, glu=glu)
        self.b13 = Frozen(b13_ef2) if b13_ef2 is not None else None
        self._empty_cache()
        self.set_cached(cached)
        if stream is not None:
            self.stream_w13, self.stream_w2 = pinned_expert_buffers(layer_experts.w13, layer_experts.w2)
        else:
            self.stream_w13 = self.stream_w2 = nnx.data(())
        self.lora = nnx.data(None)

    @property
    def cached(self) -> list[int]:
        """The experts in the device cache, by slot (empty slots left out)."""
        return [int(e) for e in np.asarray(self.cache_ids[...]) if e < self.spec.num_experts]

    def set_cached(self, experts):
        """Fills the cache with `experts` (at most `capacity`): slots whose expert stays are not copied again."""
        experts = [int(e) for e in experts]
        if len(experts) > self.spec.capacity:
            raise ValueError(f"layer {self.spec.layer}: {len(experts)} experts for a {self.spec.capacity}-slot cache")
        ids = np.asarray(self.cache_ids[...]).tolist()
        keep = set(experts) & set(ids)
        free = [s for s, e in enumerate(ids) if e not in keep]
        for e in [e for e in experts if e not in keep]:
            slot = free.pop(0)
            self.cache_w13[slot][...] = jnp.asarray(self.spec.store.w13[e], self.cache_w13[slot].dtype)
            self.cache_w2[slot][...] = jnp.asarray(self.spec.store.w2[e], self.cache_w2[slot].dtype)
            ids[slot] = e
        for slot in free:
            ids[slot] = self.spec.num_experts
        self.cache_ids[...] = jnp.asarray(ids, jnp.int32)

    def resize(self, capacity: int, experts):
        """A cache of `capacity` slots holding `experts` (new array shapes: the next call recompiles once)."""
        self.spec = dataclasses.replace(self.spec, capacity=capacity)
        self._empty_cache()
        self.set_cached(list(experts)[:capacity])

    def _empty_cache(self):
        """`capacity` slots, each expert's weights an array of its own (subset_experts reads them in place)."""
        store, capacity = self.spec.store, self.spec.capacity
        self.cache_w13 = nnx.data(
            tuple(CacheSlot(jnp.zeros(store.w13.shape[1:], store.w13.dtype)) for _ in range(capacity))
        )
        self.cache_w2 = nnx.data(
            tuple(CacheSlot(jnp.zeros(store.w2.shape[1:], store.w2.dtype)) for _ in range(capacity))
        )
        self.cache_ids = CacheSlot(jnp.full(capacity, self.spec.num_experts, jnp.int32))

    @property
    def cache_bytes(self) -> int:
        return sum(slot[...].nbytes for slot in (*self.cache_w13, *self.cache_w2))

    def device_arrays(self) -> tuple[tuple, tuple]:
        """(cache, streaming) as `hybrid_experts` takes them: the slots' weights and ids and the experts' gate/up
        biases (or None), the stream buffers."""
        b13 = None if self.b13 is None else self.b13[...]
        cache = (tuple(w[...] for w in self.cache_w13), tuple(w[...] for w in self.cache_w2), self.cache_ids[...], b13)
        streaming = (tuple(w[...] for w in self.stream_w13), tuple(w[...] for w in self.stream_w2))
        return cache, streaming

    def __call__(self, x_td, ids_tk, weights_tk):
        lora = lora_arrays(self.lora)
        ids_tk = ids_tk.astype(jnp.int32)
        if not self.spec.device_pays(x_td.shape[0]):  # decided when tracing: the call's token count is static
            return host_path(self.spec, x_td, ids_tk, weights_tk, lora)
        return hybrid_experts(self.spec, x_td, ids_tk, weights_tk, lora, *self.device_arrays())
