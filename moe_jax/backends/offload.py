"""backend="offload": experts live in pinned host memory; the routed ones are copied to the device per layer.

How it works and why: docs/INTERNALS.md, moe_jax/backends/offload.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import SingleDeviceSharding

from host_kernels import GLU, SWIGLU
from moe_jax.backends.expert_vjp import expert_function
from moe_jax.backends.metrics import MetricsRecorder
from moe_jax.model.layers import Frozen, lora_arrays
from moe_jax.model.moe import subset_experts


def memory_sharding(kind: str) -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


class TransferCounter:
    """Counts the expert copies a call makes (the routed experts of its used rounds)."""

    def __init__(self, metrics: MetricsRecorder, expert_bytes: int):
        self.metrics = metrics
        self.expert_bytes = expert_bytes

    def __hash__(self):
        return id(self)

    def record(self, experts):
        self.metrics.add(host_to_device_bytes=int(experts) * self.expert_bytes)


@dataclass(frozen=True)
class OffloadSpec:
    """Static description of one offloaded layer (a non-differentiable custom_vjp argument, so hashable)."""

    layer: int
    slots: int
    lora_scale: float
    counter: TransferCounter
    glu: GLU = SWIGLU  # the experts' activation (GPT-OSS's clamped SwiGLU)


def _fetch(spec: OffloadSpec, w13_host, w2_host, expert_ids):
    """Copies the given experts to device memory; id == num_experts fills a slot with zeros and copies nothing."""
    device = memory_sharding("device")
    num_experts = len(w13_host)

    def copy(e):
        return jax.device_put(w13_host[e], device), jax.device_put(w2_host[e], device)

    def empty():
        return jnp.zeros(w13_host[0].shape, w13_host[0].dtype), jnp.zeros(w2_host[0].shape, w2_host[0].dtype)

    branches = [functools.partial(copy, e) for e in range(num_experts)] + [empty]
    pairs = [jax.lax.switch(jnp.minimum(expert_ids[i], num_experts), branches) for i in range(spec.slots)]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)  # one array per slot (see subset_experts)


def _count_copies(spec: OffloadSpec, rounds, num_experts: int):
    """Records the experts this call copies, once per call: a callback inside each copying branch cost time every
    layer even in branches not taken (XLA:CPU)."""
    io_callback(spec.counter.record, None, jnp.sum(rounds < num_experts))


def _rounds(spec: OffloadSpec, ids_tk, num_experts: int):
    """The routed experts, padded with the "no expert" id, as [rounds, slots]."""
    rounds = -(-num_experts // spec.slots)
    counts = jnp.bincount(ids_tk.reshape(-1), length=num_experts)
    used = jnp.nonzero(counts > 0, size=rounds * spec.slots, fill_value=num_experts)[0]
    return used.reshape(rounds, spec.slots).astype(jnp.int32)


def _used_rounds(rounds, num_experts: int):
    """Rounds that hold an expert: ids are packed first, so a round is used when its first slot is."""
    return jnp.sum(rounds[:, 0] < num_experts)


def streamed_forward(spec: OffloadSpec, x_td, ids_tk, weights_tk, lora, w13_host, w2_host, rounds, b13=None):
    """Output of the pairs routed to the experts in `rounds` ([rounds, slots] ids packed first, num_experts =
    none), each round's experts copied to the device while the previous round computes. Only the rounds that
    hold experts run (a loop of dynamic length), so a decode step routed to few experts copies and computes
    only those. `b13`: every expert's gate/up biases ([e, 2f], on the device: they are small), or None."""
    num_experts = len(w13_host)
    used = _used_rounds(rounds, num_experts)
    nothing = jnp.full(spec.slots, num_experts, jnp.int32)
    _count_copies(spec, rounds, num_experts)

    def step(i, carry):
        y, w13_s, w2_s = carry
        next_ids = jnp.where(i + 1 < used, rounds[jnp.minimum(i + 1, len(rounds) - 1)], nothing)
        next_w13, next_w2 = _fetch(spec, w13_host, w2_host, next_ids)  # issued before this round computes
        y = y + subset_experts(
            x_td, ids_tk, weights_tk, rounds[i], w13_s, w2_s, num_experts, lora, spec.lora_scale, spec.glu, b13
        )
        return y, next_w13, next_w2

    first = _fetch(spec, w13_host, w2_host, rounds[0])
    y, _, _ = jax.lax.fori_loop(0, used, step, (jnp.zeros_like(x_td), *first))
    return y


def streamed_backward(spec: OffloadSpec, x_td, ids_tk, weights_tk, lora, w13_host, w2_host, rounds, dy_td, b13=None):
    """(dx, d weights, d lora) of `streamed_forward`: each used round's experts fetched again and that round
    differentiated alone, so backward holds one round of experts at a time."""
    num_experts = len(w13_host)

    _count_copies(spec, rounds, num_experts)

    def step(i, grads):
        w13_s, w2_s = _fetch(spec, w13_host, w2_host, rounds[i])

        def contribution(x, weights, lora):
            return subset_experts(
                x, ids_tk, weights, rounds[i], w13_s, w2_s, num_experts, lora, spec.lora_scale, spec.glu, b13
            )

        _, vjp = jax.vjp(contribution, x_td, weights_tk, lora)
        return jax.tree.map(jnp.add, grads, vjp(dy_td))

    zeros = jax.tree.map(jnp.zeros_like, (x_td, weights_tk, lora))
    return jax.lax.fori_loop(0, _used_rounds(rounds, num_experts), step, zeros)


def _offload_forward(spec: OffloadSpec, x_td, ids_tk, weights_tk, lora, w13_host, w2_host, b13):
    rounds = _rounds(spec, ids_tk, len(w13_host))
    return streamed_forward(spec, x_td, ids_tk, weights_tk, lora, w13_host, w2_host, rounds, b13)


def _offload_backward(spec: OffloadSpec, arguments, _kept, dy_td):
    x_td, ids_tk, weights_tk, lora, w13_host, w2_host, b13 = arguments
    rounds = _rounds(spec, ids_tk, len(w13_host))
    return streamed_backward(spec, x_td, ids_tk, weights_tk, lora, w13_host, w2_host, rounds, dy_td, b13)


offload_experts = expert_function(_offload_forward, _offload_backward)


class SpecExperts(nnx.Module):
    """An expert module whose static settings live in a frozen `spec` (a custom_vjp argument): setting the LoRA
    scale swaps in a new spec rather than mutating a hashed one."""

    @property
    def lora_scale(self) -> float:
        return self.spec.lora_scale

    @lora_scale.setter
    def lora_scale(self, scale: float):
        self.spec = dataclasses.replace(self.spec, lora_scale=float(scale))


def pinned_expert_buffers(w13_edf2, w2_efd) -> tuple[nnx.List, nnx.List]:
    """Each expert's weights as their own pinned-host buffers (a whole-buffer copy per expert to the device)."""
    host = memory_sharding("pinned_host")
    w13 = nnx.List([Frozen(jax.device_put(np.asarray(w13_edf2[e]), host)) for e in range(len(w13_edf2))])
    w2 = nnx.List([Frozen(jax.device_put(np.asarray(w2_efd[e]), host)) for e in range(len(w2_efd))])
    return w13, w2


class OffloadExperts(SpecExperts):
    """Expert backend of one layer whose weights sit in pinned host memory, one buffer per expert."""

    def __init__(
        self,
        w13_edf2: np.ndarray,
        w2_efd: np.ndarray,
        layer: int,
        slots: int,
        counter: TransferCounter,
        glu: GLU = SWIGLU,
        b13_ef2=None,
    ):
        """`glu` and `b13_ef2` (the experts' gate/up biases, kept on the device): where the experts are not a
        plain SwiGLU without biases (GPT-OSS)."""
        self.w13, self.w2 = pinned_expert_buffers(w13_edf2, w2_efd)
        self.spec = OffloadSpec(layer, min(slots, w13_edf2.shape[0]), 0.0, counter, glu)
        self.b13 = Frozen(b13_ef2) if b13_ef2 is not None else None
        self.lora = nnx.data(None)

    def __call__(self, x_td, ids_tk, weights_tk):
        lora = lora_arrays(self.lora)
        w13 = tuple(w[...] for w in self.w13)
        w2 = tuple(w[...] for w in self.w2)
        b13 = None if self.b13 is None else self.b13[...]
        return offload_experts(self.spec, x_td, ids_tk.astype(jnp.int32), weights_tk, lora, w13, w2, b13)
