"""backend="hybrid": a placement plan keeps some experts of each layer in device memory, the rest on the host.

Pairs routed to device experts are computed there (`ragged_dot` over the resident subset); the others go to the
host engine, which receives them with device-resident pairs masked out (expert id -1), so it only sees and counts
its own pairs. The host call is submitted before the device computes and collected after, so both sides work at
once: an `optimization_barrier` orders the submit before the device work, and the collect takes a one-element
slice of the device result as an input so it cannot run before it. Backward overlaps the same way.
The plan is an input here; choosing it from measurements is the planner's job.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from moe_jax.backends.host import HostRuntime
from moe_jax.backends.offload import SpecExperts
from moe_jax.layers import Frozen
from moe_jax.moe import subset_experts


@dataclass(frozen=True)
class HybridSpec:
    runtime: HostRuntime
    layer: int
    num_experts: int
    device_experts: tuple[int, ...]
    lora_scale: float

    @property
    def host_experts(self) -> tuple[int, ...]:
        return tuple(e for e in range(self.num_experts) if e not in self.device_experts)


def _host_ids(spec: HybridSpec, ids_tk):
    on_device = jnp.zeros(spec.num_experts, bool).at[jnp.asarray(spec.device_experts, jnp.int32)].set(True)
    return jnp.where(on_device[ids_tk], -1, ids_tk)


def _device_part(spec: HybridSpec, x_td, ids_tk, weights_tk, lora, w13_s, w2_s):
    slots = jnp.asarray(spec.device_experts, jnp.int32)
    return subset_experts(x_td, ids_tk, weights_tk, slots, w13_s, w2_s, spec.num_experts, lora, spec.lora_scale)


def _overlapped(spec: HybridSpec, method: str, host_args: tuple, result_shapes, device_fn, device_inputs):
    """Submits the host call, runs `device_fn(*device_inputs)` meanwhile, then collects the host result."""
    if not spec.host_experts:
        return None, device_fn(*device_inputs)
    submit = functools.partial(spec.runtime.submit, method, spec.layer, spec.lora_scale)
    ticket = io_callback(submit, jax.ShapeDtypeStruct((), jnp.int32), *host_args)
    ticket, device_inputs = jax.lax.optimization_barrier((ticket, device_inputs))
    device_out = device_fn(*device_inputs) if spec.device_experts else None
    probe = jax.tree.leaves(device_out)[0].reshape(-1)[:1] if device_out is not None else ticket
    host_out = io_callback(lambda t, _: spec.runtime.collect(t), result_shapes, ticket, probe)
    return host_out, device_out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def hybrid_experts(spec: HybridSpec, x_td, ids_tk, weights_tk, lora, w13_s, w2_s):
    host_ids = _host_ids(spec, ids_tk)
    host_y, device_y = _overlapped(
        spec,
        "forward",
        (x_td, host_ids, weights_tk, lora),
        jax.ShapeDtypeStruct(x_td.shape, x_td.dtype),
        lambda x: _device_part(spec, x, ids_tk, weights_tk, lora, w13_s, w2_s),
        (x_td,),
    )
    return sum(y for y in (host_y, device_y) if y is not None)


def _hybrid_fwd(spec, *args):
    return hybrid_experts(spec, *args), args


def _hybrid_bwd(spec, residuals, dy_td):
    x_td, ids_tk, weights_tk, lora, w13_s, w2_s = residuals
    shapes = (
        jax.ShapeDtypeStruct(x_td.shape, x_td.dtype),
        jax.ShapeDtypeStruct(weights_tk.shape, weights_tk.dtype),
        {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in lora.items()},
    )

    def device_grads(x, weights, lora_arrays):
        _, vjp = jax.vjp(lambda *a: _device_part(spec, *a[:1], ids_tk, *a[1:], w13_s, w2_s), x, weights, lora_arrays)
        return vjp(dy_td)

    host_grads, device_grads_ = _overlapped(
        spec,
        "backward",
        (x_td, _host_ids(spec, ids_tk), weights_tk, lora, dy_td),
        shapes,
        device_grads,
        (x_td, weights_tk, lora),
    )
    grads = [g for g in (host_grads, device_grads_) if g is not None]
    dx, dweights, dlora = jax.tree.map(lambda *parts: sum(parts), *grads)
    return dx, np.zeros(ids_tk.shape, dtype=jax.dtypes.float0), dweights, dlora, None, None


hybrid_experts.defvjp(_hybrid_fwd, _hybrid_bwd)


class HybridExperts(SpecExperts):
    """One layer split by a placement plan: `device_experts` resident on the device, the rest on the host."""

    def __init__(self, runtime: HostRuntime, layer: int, layer_experts, device_experts):
        device_experts = tuple(sorted(int(e) for e in device_experts))
        index = np.asarray(device_experts, dtype=np.int64)
        self.w13 = Frozen(jnp.asarray(layer_experts.w13[index]))
        self.w2 = Frozen(jnp.asarray(layer_experts.w2[index]))
        self.spec = HybridSpec(runtime, layer, layer_experts.num_experts, device_experts, 0.0)
        self.lora = nnx.data(None)

    def __call__(self, x_td, ids_tk, weights_tk):
        lora = {name: p[...] for name, p in self.lora.items()} if self.lora is not None else {}
        return hybrid_experts(self.spec, x_td, ids_tk.astype(jnp.int32), weights_tk, lora, self.w13[...], self.w2[...])
