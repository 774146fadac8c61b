"""The host engine's one face for a caller that computes routed experts: `ExpertCompute`.

It decides, call by call, between the two ways one layer's experts run: the fused native forward (one C call:
routing, GEMMs, SwiGLU, combine; no Python per expert) where the kernel choice has one and the call needs nothing
it lacks (expert LoRA, pre-activations kept for a backward), else the engine's tiled forward and backward
(`HostMoE`, which also computes every backward). What both did is reported as one record (`HostTotals`), so a
caller never merges two kinds of statistics.
"""

from __future__ import annotations

import threading

import numpy as np

from host_kernels.fused_forward import FusedTotals
from host_kernels.host_moe import HostMoE, SavedActivations
from host_kernels.lora import PROJECTIONS, ExpertLoRA

HostTotals = FusedTotals  # calls, time, flops, bytes and routed pairs since the last take, whichever path ran


class ExpertCompute:
    """Routed experts of any layer of `engine`'s store, forward and backward, on the fastest path for each call.

    `engine` and `fused` (None where the kernel choice has no fused forward) are there to be inspected; callers
    compute through the methods below."""

    def __init__(self, engine: HostMoE):
        self.engine = engine
        self.fused = engine.fused_forward()
        self._engine_totals = HostTotals(routed={})
        self._lock = threading.Lock()

    @property
    def store(self):
        return self.engine.store

    @property
    def keeps_activations(self) -> bool:
        """Whether a training forward keeps its gate/up pre-activations for the backward (else the backward
        recomputes them: x @ W13 again, reading W13 again). Float experts keep them: the fused forward (or the
        engine's) writes them as it computes them, and at a real model's shapes re-reading W13 is what costs
        (Qwen3-30B-A3B's 128 experts at 512 tokens: ~32 rows an expert, 0.8 GB of bfloat16 W13 a layer against
        25 MB kept). Quantized experts' fused forward multiplies int8-quantized activations, so their backward
        recomputes from the dequantized weights: the function it differentiates."""
        return not self.engine.kernels.quantized

    def call_address(self, layer: int) -> int:
        """The address of `layer`'s native forward (`moe_call`), which XLA's FFI handler calls; needs `fused`."""
        return self.fused.call_address(layer)

    def backward_call_address(self, layer: int) -> int:
        """The address of `layer`'s backward layer as a `moe_call` (a stream worker's backward); needs the fused
        backward (`fused.has_backward`)."""
        return self.fused.backward_call_address(layer)

    def forward(self, layer: int, x, ids, weights, lora: ExpertLoRA | None = None, keep: bool = False):
        """(y in x's dtype, pre-activations for `backward` when `keep`, else None). Without expert LoRA the fused
        forward computes it, keeping the pre-activations where asked and `keeps_activations` (on AMX the same bits
        as the engine's forward; in float32 the same function up to summation order)."""
        if self.fused is not None and lora is None and (not keep or self.keeps_activations):
            if not keep:
                return self.fused.forward(layer, np.asarray(x), np.asarray(ids), np.asarray(weights)), None
            y, h = self.fused.forward(layer, np.asarray(x), np.asarray(ids), np.asarray(weights), keep=True)
            return y, SavedActivations(layer, np.array(ids), h)
        args = (layer, np.asarray(x, np.float32), ids, np.asarray(weights, np.float32), lora)
        y, saved = self.engine.forward_keeping(*args) if keep else (self.engine.forward(*args), None)
        self._count(inputs=(x, ids, weights, *_arrays(lora)), outputs=(y,))
        return y.astype(x.dtype), saved

    def backward(self, layer: int, x, ids, weights, dy, lora: ExpertLoRA | None = None, saved=None):
        """(dx in x's dtype, routing-weight gradients in weights' dtype, ExpertLoRA of LoRA gradients or None).
        Without expert LoRA, given this call's kept pre-activations, on bfloat16 kernels: the fused backward
        (csrc/moe_backward.c; the engine's arithmetic in one native call), else the engine's."""
        fused = self.fused is not None and self.fused.has_backward and lora is None
        if fused and saved is not None and saved.layer == layer and np.array_equal(saved.ids_tk, np.asarray(ids)):
            dx, dweights = self.fused.backward(layer, np.asarray(x), np.asarray(ids), weights, dy, saved.h)
            return dx.astype(x.dtype), dweights.astype(weights.dtype), None
        dx, dweights, dlora = self.engine.backward(
            layer,
            np.asarray(x, np.float32),
            ids,
            np.asarray(weights, np.float32),
            np.asarray(dy, np.float32),
            lora,
            saved=saved,
        )
        self._count(inputs=(x, ids, weights, dy, *_arrays(lora)), outputs=(dx, dweights, *_arrays(dlora)))
        return dx.astype(x.dtype), dweights.astype(weights.dtype), dlora

    def take_totals(self) -> HostTotals:
        """What both paths did since the previous take, in one record."""
        with self._lock:
            totals, self._engine_totals = self._engine_totals, HostTotals(routed={})
        if self.fused is not None:
            totals.add(self.fused.take_totals())
        return totals

    def _count(self, inputs, outputs):
        """The engine's last call (its `last_stats`) as a HostTotals, added to the engine's."""
        s = self.engine.last_stats
        call = HostTotals(
            calls=1,
            seconds=s.wall_s,
            busy_seconds=sum(s.busy_s),
            flops=s.flops,
            weight_bytes=s.weight_bytes,
            bytes_in=sum(np.asarray(a).nbytes for a in inputs),
            bytes_out=sum(np.asarray(a).nbytes for a in outputs),
            routed={s.layer: s.tokens_per_expert} if s.kind == "forward" else {},
        )
        with self._lock:
            self._engine_totals.add(call)


def _arrays(lora: ExpertLoRA | None) -> list[np.ndarray]:
    """An ExpertLoRA's arrays (A and B of each adapted projection), for counting the bytes that crossed."""
    if lora is None:
        return []
    return [a for name in PROJECTIONS if getattr(lora, name) is not None for a in getattr(lora, name)]
