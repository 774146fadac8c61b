"""Micro-batch ping-pong between the device and the host lane: the host layer's expert call split in two.

How it works and why: docs/INTERNALS.md, moe_jax/backends/pipeline.py.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.backends.expert_vjp import gradient_shapes
from moe_jax.backends.host_runtime import HostRuntime
from moe_jax.native import stream_experts
from moe_jax.native.stream_experts import StreamCall

SCALAR = jax.ShapeDtypeStruct((), jnp.float32)


class PipelinedLayer(NamedTuple):
    """A pipelined host call's static settings: as backends.host.HostLayer, plus its micro-batch and whether it
    is the first start (`opens`) or the last finish (`closes`) of the forward pass (for the timeline)."""

    runtime: HostRuntime
    layer: int
    scale: float
    micro_batch: int
    opens: bool = False
    closes: bool = False
    stream: StreamCall | None = None  # the stream calls' site, where an undifferentiated call takes them


def _timed(call: PipelinedLayer, kind: str, opens_pass: bool, fn, *args):
    """Runs a callback's body, on the timeline's callback lane when one records."""
    timeline = call.runtime.timeline
    begun = time.perf_counter()
    result = fn(*args)
    if timeline is not None:
        timeline.add("callback", (kind, call.layer, call.micro_batch), begun, time.perf_counter(), opens_pass)
    return result


def _submit(call: PipelinedLayer, method: str, *args):
    """A callback that submits `method` and returns its ticket (the last argument only orders it)."""

    def submit(*arrays):
        *inputs, _after = arrays
        if method == "backward":
            *inputs, kept = inputs
            inputs.append(int(kept))
        label = (call.layer, call.micro_batch)
        ticket = call.runtime.submit(method, call.layer, call.scale, *inputs, label=label)
        return np.float32(ticket)

    opens = call.opens if method != "backward" else call.closes  # the backward pass opens with the last finish
    return jax.pure_callback(
        lambda *a: _timed(call, f"submit {method}", opens, submit, *a), SCALAR, *args, vmap_method="sequential"
    )


def _collect(call: PipelinedLayer, kind: str, shapes, ticket, after):
    def collect(ticket, _after):
        result = call.runtime.collect(int(ticket))
        if kind == "forward":  # `forward` returns y alone (nothing kept), `forward_keeping` (y, kept ticket)
            result = result if isinstance(result, tuple) else (result, np.int32(-1))
        return result, np.float32(ticket)

    return jax.pure_callback(
        lambda *a: _timed(call, f"collect {kind}", False, collect, *a),
        (shapes, SCALAR),
        ticket,
        after,
        vmap_method="sequential",
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def start(call: PipelinedLayer, x_td, ids_tk, weights_tk, lora, chain):
    """Submits the layer's experts for these rows; returns (ticket, chain)."""
    if call.stream is not None:
        ticket = stream_experts.submit(call.stream, x_td, ids_tk, weights_tk, after=chain).astype(jnp.float32)
    else:
        ticket = _submit(call, "forward", x_td, ids_tk, weights_tk, lora, chain)
    return ticket, ticket


def _start_forward(call: PipelinedLayer, x_td, ids_tk, weights_tk, lora, chain):
    ticket = _submit(call, "forward_keeping", x_td, ids_tk, weights_tk, lora, chain)
    return (ticket, ticket), (x_td, ids_tk, weights_tk, lora)


def _start_backward(call: PipelinedLayer, arguments, cotangents):
    x_td, ids_tk, weights_tk, lora = arguments
    backward_ticket, after = cotangents
    (dx, dweights, dlora), token = _collect(
        call, "backward", gradient_shapes(x_td, weights_tk, lora), backward_ticket, after
    )
    return dx, np.zeros(ids_tk.shape, jax.dtypes.float0), dweights, dlora, token


start.defvjp(_start_forward, _start_backward)


def _collect_forward(call: PipelinedLayer, ticket, chain, x_td):
    """(y, the kept activations' ticket or -1, chain)"""
    shapes = (jax.ShapeDtypeStruct(x_td.shape, x_td.dtype), jax.ShapeDtypeStruct((), jnp.int32))
    (y, kept), token = _collect(call, "forward", shapes, ticket, chain)
    return y, kept, token


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def finish(call: PipelinedLayer, ticket, chain, x_td, ids_tk, weights_tk, lora):
    """The layer's expert output for the rows `start` submitted (the same arguments again, for the backward);
    returns (y, chain)."""
    if call.stream is not None:
        y, token = stream_experts.sync(call.stream, ticket.astype(jnp.int32), x_td, weights_tk, after=chain)
        return y, token.astype(jnp.float32)
    y, _, token = _collect_forward(call, ticket, chain, x_td)
    return y, token


def _finish_forward(call: PipelinedLayer, ticket, chain, x_td, ids_tk, weights_tk, lora):
    y, kept, token = _collect_forward(call, ticket, chain, x_td)
    return (y, token), (x_td, ids_tk, weights_tk, lora, kept)


def _finish_backward(call: PipelinedLayer, residuals, cotangents):
    x_td, ids_tk, weights_tk, lora, kept = residuals
    dy_td, after = cotangents
    ticket = _submit(call, "backward", x_td, ids_tk, weights_tk, lora, dy_td, kept, after)
    zeros = jax.tree.map(jnp.zeros_like, (x_td, weights_tk, lora))
    return ticket, ticket, zeros[0], np.zeros(ids_tk.shape, jax.dtypes.float0), zeros[1], zeros[2]


finish.defvjp(_finish_forward, _finish_backward)
