"""backend="host" (co-compute): routed experts computed on the host CPU by host_kernels, inside the jitted model.

Each MoE layer makes one `jax.pure_callback` into the host engine, wrapped in `jax.custom_vjp` whose backward is a
second callback. Where the kernel choice has a fused native forward (a bfloat16 store on AMX or a float32 one on
AVX-512; no expert LoRA), the forward callbacks use it, and a forward that is not being differentiated calls it
directly instead, through XLA's FFI where the execution plan says so (moe_jax/planning/plan.py, moe_jax/native/ffi.py).
Expert weights stay in the host store: the callback holds a reference to it and only activations, routing and the
(small) expert LoRA arrays cross the JAX/host boundary. Attention, norms, the router and the
shared expert stay in XLA.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from host_kernels import ExpertLoRA, HostMoE
from moe_jax.backends.expert_vjp import expert_function, gradient_shapes
from moe_jax.backends.metrics import MetricsRecorder, RoutingCounts
from moe_jax.model.layers import lora_arrays
from moe_jax.native import host_experts as native_experts


class HostRuntime:
    """The host side shared by every layer of one model: the engine, its metrics, the last callback error.

    A callback cannot raise through XLA as itself, so the error is kept here and the model re-raises it at the
    call site (see `Model._run`).
    """

    def __init__(
        self,
        engine: HostMoE,
        metrics: MetricsRecorder | None = None,
        keep_bytes: int | None = None,
        experts_ffi: bool = False,
    ):
        self.engine = engine
        self.metrics = metrics or MetricsRecorder()
        self.error: BaseException | None = None
        # every pair's expert: host pairs counted where they compute, device pairs by the hybrid placements
        self.routing = RoutingCounts()
        # forward activations kept for the backward, by ticket, oldest first; beyond `keep_bytes` the oldest are
        # dropped and their backward recomputes (so does a backward whose ticket is unknown). By default only on
        # the numpy path: on AMX the recompute (one GEMM) is faster than reading the kept 2 x ffn floats per pair
        # back from RAM (bench model, 4 x 512 tokens, a layer's forward + backward: 87 ms recomputing, 103 keeping);
        # nor for quantized experts: their fused forward skips the dequantization the engine's forward pays
        keeps = engine.kernel == "numpy" and not engine.kernels.quantized
        self.keep_bytes = keep_bytes if keep_bytes is not None else (2 << 30 if keeps else 0)
        self._kept: OrderedDict[int, object] = OrderedDict()
        self._kept_bytes = 0
        # asynchronous calls (hybrid placement): one background thread drives the engine's pool
        self._background = ThreadPoolExecutor(1, thread_name_prefix="host-experts-submit")
        self._tickets = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.fused = engine.fused_forward()  # None where the kernel choice has none
        # the plan's choice: an undifferentiated call without expert LoRA goes through XLA's FFI handler
        self.experts_ffi = experts_ffi and self.fused is not None

    def __hash__(self):  # static argument of the custom_vjp: identity is what matters
        return id(self)

    def forward(self, layer: int, scale: float, x, ids, weights, lora: dict) -> np.ndarray:
        return self._guarded(self._forward, layer, scale, x, ids, weights, lora)

    def backward(self, layer: int, scale: float, x, ids, weights, lora: dict, dy, ticket=-1):
        return self._guarded(self._backward, layer, scale, x, ids, weights, lora, dy, int(ticket))

    def forward_keeping(self, layer: int, scale: float, x, ids, weights, lora: dict):
        """Forward under differentiation: also keeps the pre-activations for the backward; returns (y, ticket)."""
        return self._guarded(self._forward_keeping, layer, scale, x, ids, weights, lora)

    def _forward_keeping(self, layer, scale, x, ids, weights, lora):
        y, saved = self._run_forward(layer, scale, x, ids, weights, lora, keep=self.keep_bytes > 0)
        if saved is None:
            return y, np.int32(-1)
        with self._lock:
            ticket = next(self._tickets)
            self._kept[ticket] = saved
            self._kept_bytes += saved.nbytes
            while self._kept_bytes > self.keep_bytes and self._kept:
                self._kept_bytes -= self._kept.popitem(last=False)[1].nbytes
        return y, np.int32(ticket)

    def _take_kept(self, ticket: int):
        with self._lock:
            saved = self._kept.pop(ticket, None)
            if saved is not None:
                self._kept_bytes -= saved.nbytes
        return saved

    def _guarded(self, fn, *args, device_waits: bool = True):
        start = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as e:
            self.error = e
            raise
        finally:
            if device_waits:
                self.metrics.add(device_wait_s=time.perf_counter() - start)

    def submit(self, method: str, *args) -> np.ndarray:
        """Starts `forward` or `backward` in the background; returns a ticket for `collect`."""
        fn = {"forward": self._forward, "backward": self._backward}[method]

        def run():
            result = self._guarded(fn, *args, device_waits=False)
            return result, time.perf_counter()

        ticket = next(self._tickets)
        with self._lock:
            self._pending[ticket] = self._background.submit(run)
        return np.int32(ticket)

    def collect(self, ticket) -> object:
        """Waits for a submitted call. Time blocked here is the device side waiting for the host; time the
        result sat finished before this call is the host waiting for the device side."""
        with self._lock:
            future = self._pending.pop(int(ticket))
        start = time.perf_counter()
        try:
            result, finished = future.result()
        except BaseException as e:
            self.error = e
            raise
        now = time.perf_counter()
        self.metrics.add(device_wait_s=now - start, host_wait_s=max(0.0, start - finished))
        return result

    def _forward(self, layer, scale, x, ids, weights, lora):
        return self._run_forward(layer, scale, x, ids, weights, lora, keep=False)[0]

    def fold_fused_metrics(self):
        """Adds what the fused forward did since the last fold to the metrics (it counts in native code, whoever
        called it: the FFI handler or `_run_forward`)."""
        if self.fused is None:
            return
        t = self.fused.take_totals()
        if t.calls:
            self.metrics.add(
                device_to_host_bytes=t.bytes_in,
                host_to_device_bytes=t.bytes_out,
                host_busy_s=t.busy_seconds,
                host_wall_s=t.seconds,
                # the jitted step waited on the calls it made through the FFI handler; callers through Python
                # (callbacks, hybrid submits) record their own waits in `_guarded` / `collect`
                device_wait_s=t.xla_call_seconds,
                host_flops=t.flops,
                host_weight_bytes=t.weight_bytes,
                host_calls=t.calls,
            )
        for layer, counts in t.routed.items():
            if counts.any():
                self.metrics.count_tokens(layer, counts)
                self.routing.add(layer, counts)

    def _run_forward(self, layer, scale, x, ids, weights, lora, keep: bool):
        """(y in x's dtype, saved pre-activations when `keep`, else None), with the call's metrics recorded.
        Without expert LoRA or kept activations, the fused native forward computes it (on AMX the same bits as
        the engine's forward, in float32 the same function up to summation order; its metrics are folded in from
        its own counts): training's bfloat16 forward and the hybrid placements' host share go that way."""
        if self.fused is not None and not lora and not keep:
            return self.fused.forward(layer, np.asarray(x), np.asarray(ids), np.asarray(weights)), None
        args = (layer, np.asarray(x, np.float32), ids, np.asarray(weights, np.float32), _expert_lora(scale, lora))
        y, saved = self.engine.forward_keeping(*args) if keep else (self.engine.forward(*args), None)
        self._record(layer, inputs=(x, ids, weights, *lora.values()), outputs=(y,))
        return y.astype(x.dtype), saved

    def _backward(self, layer, scale, x, ids, weights, lora, dy, ticket=-1):
        dx, dweights, dlora = self.engine.backward(
            layer,
            np.asarray(x, np.float32),
            ids,
            np.asarray(weights, np.float32),
            np.asarray(dy, np.float32),
            _expert_lora(scale, lora),
            saved=self._take_kept(ticket) if ticket >= 0 else None,
        )
        grads = {name: getattr(dlora, name.split("_")[0])[name.endswith("_b")] for name in lora}
        self._record(layer, inputs=(x, ids, weights, dy, *lora.values()), outputs=(dx, dweights, *grads.values()))
        return dx.astype(x.dtype), dweights.astype(weights.dtype), grads

    def _record(self, layer, inputs, outputs):
        s = self.engine.last_stats
        self.metrics.add(
            device_to_host_bytes=sum(np.asarray(a).nbytes for a in inputs),
            host_to_device_bytes=sum(a.nbytes for a in outputs),
            host_busy_s=sum(s.busy_s),
            host_wall_s=s.wall_s,
            host_flops=s.flops,
            host_weight_bytes=s.weight_bytes,
            host_calls=1,
        )
        if s.kind == "forward":
            self.metrics.count_tokens(layer, s.tokens_per_expert)
            self.routing.add(layer, s.tokens_per_expert)


def _expert_lora(scale: float, lora: dict) -> ExpertLoRA | None:
    """{gate_a, gate_b, ...} arrays from the model into the engine's ExpertLoRA (None when empty)."""
    if not lora:
        return None
    pairs = {}
    for name in ("gate", "up", "down"):
        if f"{name}_a" in lora:
            pairs[name] = (np.asarray(lora[f"{name}_a"], np.float32), np.asarray(lora[f"{name}_b"], np.float32))
    return ExpertLoRA(scale, **pairs)


class HostLayer(NamedTuple):
    """A host expert call's static settings: the runtime (hashed by identity), the layer, the LoRA scale."""

    runtime: HostRuntime
    layer: int
    scale: float


def _forward(call: HostLayer, x_td, ids_tk, weights_tk, lora):
    """y = routed experts of the layer applied to x, computed by the host engine: the fused native forward through
    XLA's FFI where the plan says so, else a callback (which uses the fused forward where it can, _run_forward)."""
    runtime, layer, scale = call
    if runtime.experts_ffi and not lora:
        address = runtime.fused.call_address(layer)
        return native_experts.host_experts_call(address, x_td, ids_tk, weights_tk)
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
    """Under differentiation: the forward keeps what the backward reads, under a ticket the backward redeems."""
    runtime, layer, scale = call
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
    """Expert backend of one layer whose weights live in the host store (not in any traced pytree)."""

    def __init__(self, runtime: HostRuntime, layer: int):
        self.runtime = runtime
        self.layer = layer
        self.lora_scale = 0.0
        self.lora = nnx.data(None)  # nnx.Dict of LoRAParam: gate_a [e, d, r], gate_b [e, r, f], ... when attached

    def __call__(self, x_td, ids_tk, weights_tk):
        call = HostLayer(self.runtime, self.layer, self.lora_scale)
        return host_experts(call, x_td, ids_tk.astype(jnp.int32), weights_tk, lora_arrays(self.lora))
