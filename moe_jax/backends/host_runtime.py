"""The host side shared by every host-expert layer of one model, as the jitted model's callbacks meet it: the
host engine's one face (`host_kernels.ExpertCompute`), the activations a forward keeps for its backward, the
background calls the hybrid placements overlap with device work, the callbacks' errors, and the figures they add
to the model's metrics."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from host_kernels import ExpertCompute, ExpertLoRA, HostKernelError, StreamWorker
from host_kernels.stream_worker import BACKWARD, FORWARD
from moe_jax.backends.lane_timeline import LaneTimeline
from moe_jax.backends.metrics import MetricsRecorder, RoutingCounts
from moe_jax.native import stream_experts
from moe_jax.planning.plan import CALLBACK, STREAM

# tickets wrap here so that one survives a round trip through float32 (the pipeline's tickets are floats: their
# cotangents carry the backward's tickets, backends/pipeline.py); far more than can ever be pending at once
TICKET_WRAP = 1 << 23


class KeptActivations:
    """Forward pre-activations kept for the backward, by ticket, oldest first; beyond `budget` bytes the oldest
    are dropped and their backward recomputes (so does a backward whose ticket is unknown)."""

    def __init__(self, budget: int):
        self.budget = budget
        self._kept: OrderedDict[int, object] = OrderedDict()
        self._bytes = 0
        self._tickets = itertools.count()
        self._lock = threading.Lock()

    def keep(self, saved) -> np.int32:
        """A ticket for `saved` (-1 for None)."""
        if saved is None:
            return np.int32(-1)
        with self._lock:
            ticket = next(self._tickets)
            self._kept[ticket] = saved
            self._bytes += saved.nbytes
            while self._bytes > self.budget and self._kept:
                self._bytes -= self._kept.popitem(last=False)[1].nbytes
        return np.int32(ticket)

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, ticket: int):
        """The activations kept under `ticket`, or None (never kept, or dropped)."""
        if ticket < 0:
            return None
        with self._lock:
            saved = self._kept.pop(ticket, None)
            if saved is not None:
                self._bytes -= saved.nbytes
        return saved


class HostRuntime:
    """What every host-expert layer of one model shares. A callback cannot raise through XLA as itself, so its
    error is kept here and the model re-raises it at the call site (`Model.host_errors`)."""

    def __init__(
        self,
        compute: ExpertCompute,
        metrics: MetricsRecorder | None = None,
        keep_bytes: int | None = None,
        host_call: str = CALLBACK,
        stream_signal: str = "",
    ):
        self.compute = compute
        self.metrics = metrics or MetricsRecorder()
        self.error: BaseException | None = None
        # every pair's expert: host pairs counted where they compute, device pairs by the hybrid placements
        self.routing = RoutingCounts()
        default_keep = 2 << 30 if compute.keeps_activations else 0
        self.kept = KeptActivations(keep_bytes if keep_bytes is not None else default_keep)
        # asynchronous calls (hybrid placement): one background thread drives the engine's pool
        self._background = ThreadPoolExecutor(1, thread_name_prefix="host-experts-submit")
        self._tickets = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        # the plan's choice (which had the fused forward in view); `call_kind` applies it to each call
        if host_call != CALLBACK and compute.fused is None:
            raise ValueError(f"host call {host_call!r} needs the fused forward, and this engine has none")
        self.host_call = host_call
        self.stream_signal = stream_signal
        self.stream: StreamWorker | None = None
        if self.host_call == STREAM:
            self.stream = StreamWorker(memory="cuda" if stream_experts.platform_name() == "cuda" else "host")
        self._slots = itertools.count()
        # per-lane timestamps of the pipelined calls while a LaneTimeline records them (LaneTimeline.recording)
        self.timeline: LaneTimeline | None = None

    def __hash__(self):  # part of a static custom_vjp argument: identity is what matters
        return id(self)

    def call_kind(self, lora, training: bool = False) -> str:
        """How one call of the experts reaches them (FFI, STREAM or CALLBACK): the plan's host call, except that
        a call with expert LoRA is a callback (the native calls take none), and so is a training call (forward
        keeping pre-activations, or backward) unless the stream calls run it: the fused backward (bfloat16
        kernels) over what the fused forward keeps. XLA:CPU's FFI handler runs forwards only."""
        if lora:
            return CALLBACK
        if not training:
            return self.host_call
        fused = self.compute.fused
        stream_backward = self.host_call == STREAM and fused.has_backward and self.compute.keeps_activations
        return STREAM if stream_backward else CALLBACK

    def prepare_native_calls(self, training: bool = False):
        """Packs what the plan's native calls read, before a step that calls them is traced: every layer's fused
        forward where the plan names FFI or stream calls (at load); with `training`, also the fused backward's
        layers where the stream calls run a training step's backward (when a training step is prepared)."""
        if self.host_call == CALLBACK:
            return
        layers = sorted(self.compute.store.layers)
        self.compute.fused.prepare(layers)
        if training and self.call_kind(None, training=True) == STREAM:
            self.compute.fused.prepare(layers, backward=True)

    def stream_call(self, layer: int, kind: str = FORWARD) -> stream_experts.StreamCall:
        """A new call site of `layer`'s experts (`kind`: host_kernels.stream_worker.KINDS) on the stream worker, on
        the next slot (consecutive sites of a traced program take consecutive slots, so calls in flight together
        never share one)."""
        slot = next(self._slots) % stream_experts.SLOTS
        address = self.compute.backward_call_address(layer) if kind == BACKWARD else self.compute.call_address(layer)
        return stream_experts.StreamCall(self.stream.address, address, layer, slot, self.stream_signal, kind)

    def take_stream_error(self) -> BaseException | None:
        """A failed stream call's error, by layer (its results were NaN), or None."""
        error = self.stream.take_error() if self.stream is not None else None
        if error is None:
            return None
        return HostKernelError(f"host experts failed at layer {error.layer}: {error.message}")

    # --- the callbacks (the jitted step waits on each: its wait is the device waiting for the host)
    def forward(self, layer: int, scale: float, x, ids, weights, lora: dict) -> np.ndarray:
        return self._guarded(self._forward, layer, scale, x, ids, weights, lora)

    def forward_keeping(self, layer: int, scale: float, x, ids, weights, lora: dict):
        """Forward under differentiation: also keeps the pre-activations for the backward; returns (y, ticket)."""
        return self._guarded(self._forward_keeping, layer, scale, x, ids, weights, lora)

    def backward(self, layer: int, scale: float, x, ids, weights, lora: dict, dy, ticket=-1):
        return self._guarded(self._backward, layer, scale, x, ids, weights, lora, dy, int(ticket))

    # --- background calls (hybrid: the host computes while the device does its share)
    def submit(self, method: str, *args, label: tuple = ()) -> np.ndarray:
        """Starts `forward`, `forward_keeping` or `backward` in the background (one at a time, in the order
        submitted); returns a ticket for `collect`. `label` names the call on the timeline's host lane."""
        fn = {"forward": self._forward, "forward_keeping": self._forward_keeping, "backward": self._backward}[method]
        timeline = self.timeline

        def run():
            begun = time.perf_counter()
            result = self._guarded(fn, *args, device_waits=False)
            finished = time.perf_counter()
            if timeline is not None:
                timeline.add("host", (method, *label), begun, finished)
            return result, finished

        ticket = next(self._tickets) % TICKET_WRAP
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

    def fold_host_metrics(self):
        """Adds what the host computed since the last fold (both paths, counted where they run, whoever called
        them: XLA's FFI handler or a callback) to the metrics and the routing counts."""
        t = self.compute.take_totals()
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

    def _forward(self, layer, scale, x, ids, weights, lora):
        return self.compute.forward(layer, x, ids, weights, _expert_lora(scale, lora))[0]

    def _forward_keeping(self, layer, scale, x, ids, weights, lora):
        keep = self.kept.budget > 0
        y, saved = self.compute.forward(layer, x, ids, weights, _expert_lora(scale, lora), keep=keep)
        return y, self.kept.keep(saved)

    def _backward(self, layer, scale, x, ids, weights, lora, dy, ticket=-1):
        saved = self.kept.take(ticket)
        dx, dweights, dlora = self.compute.backward(layer, x, ids, weights, dy, _expert_lora(scale, lora), saved)
        grads = {name: getattr(dlora, name.split("_")[0])[name.endswith("_b")] for name in lora}
        return dx, dweights, grads


def _expert_lora(scale: float, lora: dict) -> ExpertLoRA | None:
    """{gate_a, gate_b, ...} arrays from the model into the engine's ExpertLoRA (None when empty)."""
    if not lora:
        return None
    pairs = {}
    for name in ("gate", "up", "down"):
        if f"{name}_a" in lora:
            pairs[name] = (np.asarray(lora[f"{name}_a"], np.float32), np.asarray(lora[f"{name}_b"], np.float32))
    return ExpertLoRA(scale, **pairs)
