"""backend="host" (co-compute): routed experts computed on the host CPU by host_kernels, inside the jitted model.

How it works and why: docs/INTERNALS.md, moe_jax/backends/host.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from host_kernels.stream_worker import BACKWARD, FORWARD_KEEPING
from moe_jax.backends import pipeline
from moe_jax.backends.expert_parallel import sharded_experts
from moe_jax.backends.expert_vjp import expert_function, gradient_shapes
from moe_jax.backends.host_runtime import HostRuntime
from moe_jax.model.layers import lora_arrays
from moe_jax.native import host_experts as native_experts
from moe_jax.native import stream_experts
from moe_jax.planning.plan import FFI, STREAM


class HostLayer(NamedTuple):
    """A host expert call's static settings: the runtime (hashed by identity), the layer, the LoRA scale."""

    runtime: HostRuntime
    layer: int
    scale: float


def _forward(call: HostLayer, x_td, ids_tk, weights_tk, lora):
    """y = routed experts of the layer applied to x, computed by the host engine: the fused native forward through
    XLA's FFI or the stream calls where the plan says so, else a callback (which uses the fused forward where it
    can, _run_forward)."""
    runtime, layer, scale = call
    kind = runtime.call_kind(lora)
    if kind == FFI:
        address = runtime.compute.call_address(layer)
        return native_experts.host_experts_call(address, x_td, ids_tk, weights_tk)
    if kind == STREAM:
        return stream_experts.host_experts_call(runtime.stream_call(layer), x_td, ids_tk, weights_tk)
    return jax.pure_callback(
        functools.partial(runtime.forward, layer, scale),
        jax.ShapeDtypeStruct(x_td.shape, x_td.dtype),
        x_td,
        ids_tk,
        weights_tk,
        lora,
        vmap_method="sequential",
    )


def _forward_keeping(call: HostLayer, x_td, ids_tk, weights_tk, lora):
    """Under differentiation: the forward keeps what the backward reads, under a ticket the backward redeems (on
    the stream calls: the keeping forward's site, which holds them)."""
    runtime, layer, scale = call
    if runtime.call_kind(lora, training=True) == STREAM:
        site = runtime.stream_call(layer, FORWARD_KEEPING)
        y, ticket = stream_experts.sync(site, stream_experts.submit(site, x_td, ids_tk, weights_tk), x_td, weights_tk)
        return y, ticket
    return jax.pure_callback(
        functools.partial(runtime.forward_keeping, layer, scale),
        (jax.ShapeDtypeStruct(x_td.shape, x_td.dtype), jax.ShapeDtypeStruct((), jnp.int32)),
        x_td,
        ids_tk,
        weights_tk,
        lora,
        vmap_method="sequential",
    )


def _backward(call: HostLayer, arguments, ticket, dy_td):
    runtime, layer, scale = call
    x_td, ids_tk, weights_tk, lora = arguments
    if runtime.call_kind(lora, training=True) == STREAM:  # the fused backward over what the forward's site holds
        site = runtime.stream_call(layer, BACKWARD)
        dy, weights = dy_td.astype(jnp.float32), weights_tk.astype(jnp.float32)
        submitted = stream_experts.submit(site, dy, ids_tk, weights, forward_ticket=ticket)
        dx, dweights, _ = stream_experts.sync(site, submitted, dy, weights)
        return dx.astype(x_td.dtype), dweights.astype(weights_tk.dtype), {}
    return jax.pure_callback(
        functools.partial(runtime.backward, layer, scale),
        gradient_shapes(x_td, weights_tk, lora),
        x_td,
        ids_tk,
        weights_tk,
        lora,
        dy_td,
        ticket,
        vmap_method="sequential",
    )


host_experts = expert_function(_forward, _backward, _forward_keeping)


class HostExperts(nnx.Module):
    """Expert backend of one layer whose weights live in the host store (not in any traced pytree).

    With `experts_per_shard` (expert parallel), the store holds one process's shard of the layer's experts and
    the layer runs inside a step over all processes (backends/expert_parallel.py)."""

    def __init__(self, runtime: HostRuntime, layer: int, experts_per_shard: int | None = None):
        self.runtime = runtime
        self.layer = layer
        self.experts_per_shard = experts_per_shard
        self.lora_scale = 0.0
        self.lora = nnx.data(None)  # nnx.Dict of LoRAParam: gate_a [e, d, r], gate_b [e, r, f], ... when attached

    def __call__(self, x_td, ids_tk, weights_tk):
        call = HostLayer(self.runtime, self.layer, self.lora_scale)
        ids_tk, lora = ids_tk.astype(jnp.int32), lora_arrays(self.lora)
        if self.experts_per_shard is not None:
            return sharded_experts(host_experts, call, self.experts_per_shard, x_td, ids_tk, weights_tk, lora)
        return host_experts(call, x_td, ids_tk, weights_tk, lora)

    # --- pipelined (backends/pipeline.py): submitted now, collected by `finish` after the device's other work
    def start(self, x_td, ids_tk, weights_tk, chain, micro_batch: int, opens: bool = False):
        if self.experts_per_shard is not None:  # expert parallel's collectives run in the call: no split
            return self(x_td, ids_tk, weights_tk), chain
        ids_tk, lora = ids_tk.astype(jnp.int32), lora_arrays(self.lora)
        stream = self.runtime.stream_call(self.layer) if self.runtime.call_kind(lora) == STREAM else None
        call = pipeline.PipelinedLayer(self.runtime, self.layer, self.lora_scale, micro_batch, opens, stream=stream)
        ticket, chain = pipeline.start(call, x_td, ids_tk, weights_tk, lora, chain)
        return (call, ticket, x_td, ids_tk, weights_tk, lora), chain

    def finish(self, pending, chain, closes: bool = False):
        if not isinstance(pending, tuple):  # computed by `start`
            return pending, chain
        call, ticket, x_td, ids_tk, weights_tk, lora = pending
        return pipeline.finish(call._replace(opens=False, closes=closes), ticket, chain, x_td, ids_tk, weights_tk, lora)
