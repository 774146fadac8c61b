"""The host expert engine: grouped SwiGLU experts of one layer, forward and backward, on worker threads.

How it works and why: docs/INTERNALS.md, host_kernels/host_moe.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from host_kernels import native
from host_kernels.activations import GLU, SWIGLU, swiglu_backward, swiglu_forward
from host_kernels.choice import NUMPY, KernelChoice, check_choice, choose_kernels
from host_kernels.errors import HostKernelError, NonFiniteError
from host_kernels.expert_matmuls import DequantizedExperts, expert_matmuls
from host_kernels.fused_forward import FusedForward, pack_layer
from host_kernels.layer_experts import LayerExperts
from host_kernels.lora import ExpertLoRA
from host_kernels.pool import WorkerPool
from host_kernels.schedule import Routing, Tile, check_expert_ids, max_column_blocks, plan_tiles
from host_kernels.stats import CallStats
from host_kernels.store import ExpertStore
from host_kernels.workspace import Workspace

# An expert with at most this many rows is weight-bound: decode-sized calls run each expert as one task.
FUSED_MAX_ROWS = 16


class HostMoE:
    """Computes routed experts of any layer of `store` on the host CPU, with the kernels `kernels` names
    (default: `choose_kernels(store.dtype)`, the fastest this machine runs)."""

    def __init__(
        self,
        store: ExpertStore,
        threads: int | None = None,
        pool: WorkerPool | None = None,
        kernels: KernelChoice | None = None,
        glu: GLU = SWIGLU,
        gate_up_bias: Mapping[int, np.ndarray] | None = None,
    ):
        """`glu` and `gate_up_bias` (by layer: [experts, 2 ffn], gate then up) where the experts are not a plain
        SwiGLU without biases (GPT-OSS)."""
        self.store = store
        self.glu = glu
        self.gate_up_bias = {layer: np.ascontiguousarray(b, np.float32) for layer, b in (gate_up_bias or {}).items()}
        self.kernels = kernels or choose_kernels(store.dtype, quant=store.quant)
        check_choice(self.kernels, store.dtype, store.quant)
        self._swiglu_isa = None if self.kernels.activations == NUMPY else self.kernels.activations
        self.pool = pool or WorkerPool(threads)
        self.last_stats: CallStats | None = None
        self._matmuls = {}
        self.workspace = Workspace()  # temporaries reused from call to call
        self.dequantized = DequantizedExperts()  # a quantized store's float32 experts for the GEMMs, all layers'
        self._one_call_at_a_time = threading.Lock()  # calls share the workspace
        self._fused: FusedForward | None = None

    @property
    def kernel(self) -> str:
        """Which GEMM path runs the engine's experts: "amx-bf16", "avx512-bf16" or "avx2-bf16" (a bfloat16 store on
        a CPU with those kernels, or an int4 one on AVX-512, its experts dequantized to their tiles), or "numpy"."""
        return self.kernels.gemm

    def _layer_matmuls(self, layer: int, backward: bool = False):
        mm = self._matmuls.get(layer)
        if mm is None:
            w, gemm = self.store[layer], self.kernels.gemm
            mm = self._matmuls[layer] = expert_matmuls(w, gemm, self.workspace, layer, self.dequantized)
        mm.prepare(backward)
        return mm

    def fused_forward(self) -> FusedForward | None:
        """The native fused forward (host_kernels/fused_forward.py), or None where the kernel choice has none.
        Made once; with a bfloat16 kernel it shares the packed weights with `forward` and, for its fused
        backward, with `backward`."""
        if self._fused is None and self.kernels.fused:
            shared = self.kernels.fused == self.kernels.gemm  # one packing: the fused backward reads the engine's too
            backward = self._packed_backward_weights if shared else None
            self._fused = FusedForward(
                self.store,
                self._packed_forward_weights,
                self.threads,
                self.kernels.fused,
                packed_backward=backward,
                glu=self.glu,
                gate_up_bias=self.gate_up_bias,
            )
        return self._fused

    def _packed_backward_weights(self, layer: int) -> list:
        """(W2ᵀ, W13ᵀ) of `layer`'s experts, packed as the engine's backward GEMMs read them (made once)."""
        return self._layer_matmuls(layer, backward=True).backward_weights()

    def _packed_forward_weights(self, layer: int) -> list:
        """The fused forward's packed weights of `layer`: with a bfloat16 kernel on both, the engine's (one copy,
        shared); a quantized layer's own; else packed for it. A float store's mapped pages then leave memory (the
        copy replaced them; a GEMM that reads the store again reads them from the file)."""
        if self.kernels.fused == self.kernels.gemm:
            packed = self._layer_matmuls(layer).forward_weights()
        else:
            packed = pack_layer(self.store[layer], self.kernels.fused)
        self.store.release_pages(layer)
        native.trim_heap()  # the packing's temporaries
        return packed

    @property
    def threads(self) -> int:
        return self.pool.threads

    # ---------------------------------------------------------------- forward
    def forward(self, layer: int, x_td, ids_tk, weights_tk, lora: ExpertLoRA | None = None) -> np.ndarray:
        return self._forward(layer, x_td, ids_tk, weights_tk, lora, keep=False)[0]

    def forward_keeping(self, layer: int, x_td, ids_tk, weights_tk, lora: ExpertLoRA | None = None):
        """Forward that also returns the gate/up pre-activations, so `backward(..., saved=)` skips recomputing
        them (one x @ W13 GEMM, 4 of the 16 GEMM FLOP units of forward+backward) at pairs x 2f floats of memory."""
        return self._forward(layer, x_td, ids_tk, weights_tk, lora, keep=True)

    def _forward(self, layer, x_td, ids_tk, weights_tk, lora, keep: bool):
        with self._one_call_at_a_time:
            return self._forward_locked(layer, x_td, ids_tk, weights_tk, lora, keep)

    def _forward_locked(self, layer, x_td, ids_tk, weights_tk, lora, keep: bool):
        start = time.perf_counter()
        w = self.store[layer]
        x_td, ids_tk, weights_tk = _check_inputs(layer, w, x_td, ids_tk, weights_tk, lora)
        mm = self._layer_matmuls(layer)
        stats = CallStats("forward", layer)
        routing = Routing.build(ids_tk, w.num_experts)
        stats.tokens_per_expert = routing.sizes
        weight_s = weights_tk.reshape(-1)[routing.order]
        f, d = w.ffn, w.hidden
        act = mm.input_buffer("activations", routing.pairs, f, float32=lora is not None and lora.down is not None)
        out_s = self._rows_plus_zero_row("expert outputs", routing.pairs, d)  # weighted, in expert-sorted order
        h_s = np.empty((routing.pairs, 2 * f), np.float32) if keep else None

        def gate_up(tile: Tile):
            hg, hu = _gate_up(mm, lora, tile, x_td, routing.token_of_pair[tile.rows], self.gate_up_bias.get(layer))
            if keep:
                h_s[tile.rows, tile.cols] = hg
                h_s[tile.rows, f + tile.cols.start : f + tile.cols.stop] = hu
            swiglu_forward(hg, hu, act[tile.rows, tile.cols], isa=self._swiglu_isa, glu=self.glu)

        def down(tile: Tile):
            o = out_s[tile.rows, tile.cols]
            mm.down(tile.expert, act, tile.rows, tile.cols, o)
            if lora is not None and lora.down is not None:
                a, b = lora.down
                o += lora.scale * ((act[tile.rows] @ a[tile.expert]) @ b[tile.expert][:, tile.cols])
            o *= weight_s[tile.rows, None]

        active = np.flatnonzero(routing.sizes)
        if len(active) >= self.threads and routing.sizes.max() <= FUSED_MAX_ROWS:
            # decode-sized: one task per expert runs both phases, so the workers meet once, not twice; each
            # expert's work is reading its weights, and there are enough experts to go round
            def expert(e):
                rows = slice(int(routing.offsets[e]), int(routing.offsets[e + 1]))
                gate_up(Tile(e, rows, slice(0, f), 0, 0.0))
                down(Tile(e, rows, slice(0, d), 0, 0.0))

            order = sorted(active.tolist(), key=lambda e: -routing.sizes[e])
            self._run_tasks(stats, layer, [lambda e=e: expert(e) for e in order])
            stats.flops += 2.0 * routing.pairs * 3 * d * f
            stats.weight_bytes += len(active) * 3 * d * f * w.bytes_per_weight
        else:
            self._run(stats, layer, plan_tiles(routing, f, self.threads), gate_up, w, phase_width=2 * d)
            self._run(stats, layer, plan_tiles(routing, d, self.threads), down, w, phase_width=f)
        y = self._combine(stats, layer, out_s, routing)
        stats.wall_s = time.perf_counter() - start
        self.last_stats = stats
        return y, (SavedActivations(layer, ids_tk.copy(), h_s) if keep else None)

    def _combine(self, stats: CallStats, layer: int, rows_sorted, routing: Routing) -> np.ndarray:
        """y_t = sum over t's slots of the expert-sorted rows: a gather and add, split over token blocks.

        `rows_sorted` has one extra zero row at the end, where pairs not routed here point.
        """
        position = routing.position
        tokens, top_k = position.shape
        y = np.empty((tokens, rows_sorted.shape[1]), np.float32)

        def gather_sum(block: slice):
            np.take(rows_sorted, position[block, 0], axis=0, out=y[block])
            for slot in range(1, top_k):
                y[block] += rows_sorted[position[block, slot]]

        step = max(64, -(-tokens // (2 * self.threads)))
        if tokens <= step:  # one block: not worth waking the workers
            gather_sum(slice(0, tokens))
            return y
        self._run_tasks(stats, layer, [lambda b=slice(t, t + step): gather_sum(b) for t in range(0, tokens, step)])
        return y

    # ---------------------------------------------------------------- backward
    def backward(
        self,
        layer: int,
        x_td,
        ids_tk,
        weights_tk,
        dy_td,
        lora: ExpertLoRA | None = None,
        saved: SavedActivations | None = None,
    ):
        """Returns (dx [t, d], d_weights [t, k], LoRA gradients as an ExpertLoRA or None).

        `saved` (from `forward_keeping` on the same inputs) replaces recomputing the gate/up pre-activations; it is
        consumed (overwritten in place). Saved activations of another layer or routing are ignored.
        """
        with self._one_call_at_a_time:
            return self._backward_locked(layer, x_td, ids_tk, weights_tk, dy_td, lora, saved)

    def _backward_locked(self, layer, x_td, ids_tk, weights_tk, dy_td, lora, saved):
        start = time.perf_counter()
        w = self.store[layer]
        x_td, ids_tk, weights_tk = _check_inputs(layer, w, x_td, ids_tk, weights_tk, lora)
        dy_td = _check_activations(layer, "output gradient", dy_td, x_td.shape)
        mm = self._layer_matmuls(layer, backward=True)
        stats = CallStats("backward", layer)
        routing = Routing.build(ids_tk, w.num_experts)
        stats.tokens_per_expert = routing.sizes
        weight_s = weights_tk.reshape(-1)[routing.order]
        f, d, p = w.ffn, w.hidden, routing.pairs
        keep_act = lora is not None and lora.down is not None
        dh = mm.input_buffer("pre-activation gradient", p, 2 * f, float32=lora is not None)  # at gate/up
        act = np.empty((p, f), np.float32) if keep_act else None
        active = np.flatnonzero(routing.sizes)
        # each expert's weights made for it (dequantized): one task per expert runs both passes, so each expert is
        # made once, not once a pass; there are enough experts to go round
        per_expert = mm.makes_weights and len(active) >= 2 * self.threads
        tiles1 = [] if per_expert else plan_tiles(routing, f, self.threads)
        dw_blocks = np.zeros((p, max_column_blocks(tiles1) if tiles1 else 1), np.float32)
        if saved is not None and not (saved.layer == layer and np.array_equal(saved.ids_tk, ids_tk)):
            saved = None
        # the inputs' rows in sorted order: for recomputing the pre-activations and for expert LoRA's gradients
        x_s = x_td[routing.token_of_pair] if saved is None or lora is not None else None
        dy_s = dy_td[routing.token_of_pair]

        def recompute_and_differentiate(tile: Tile):
            e, rows, cols = tile.expert, tile.rows, tile.cols
            dy_r = dy_s[rows]
            if saved is not None:
                hg, hu = saved.h[rows, cols], saved.h[rows, f + cols.start : f + cols.stop]
            else:
                hg, hu = _gate_up(mm, lora, tile, x_s[rows], None, self.gate_up_bias.get(layer))
            g = mm.down_t(e, dy_r, cols)  # dL/da before the routing weight
            if lora is not None and lora.down is not None:
                a_d, b_d = lora.down
                g += lora.scale * ((dy_r @ b_d[e].T) @ a_d[e][cols, :].T)
            dh_gate, dh_up = dh[rows, cols], dh[rows, f + cols.start : f + cols.stop]
            a = act[rows, cols] if keep_act else None
            swiglu_backward(
                hg,
                hu,
                g,
                weight_s[rows],
                dh_gate,
                dh_up,
                dw_blocks[rows, tile.block],
                a,
                isa=self._swiglu_isa,
                glu=self.glu,
            )

        phase_width = d if saved is not None else 2 * d + d  # the g GEMM, plus the recomputed gate/up
        if not per_expert:
            self._run(stats, layer, tiles1, recompute_and_differentiate, w, phase_width=phase_width)

        dx_s = self._rows_plus_zero_row("input gradients", p, d)  # per pair, expert-sorted

        def input_grad(tile: Tile):
            e, rows, cols = tile.expert, tile.rows, tile.cols
            dx = dx_s[rows, cols]
            mm.gate_up_t(e, dh, rows, cols, dx)
            if lora is not None:
                for pair, dh_part in ((lora.gate, dh[rows, :f]), (lora.up, dh[rows, f:])):
                    if pair is not None:
                        dx += lora.scale * ((dh_part @ pair[1][e].T) @ pair[0][e][cols, :].T)

        grads = lora.zeros_like() if lora is not None else None

        def lora_grads(e):  # expert e's LoRA gradients: from its own rows' dh
            _lora_grads(e, routing, lora, grads, x_s, dy_s, weight_s, dh, act, f)

        if per_expert:

            def expert(e):
                rows = slice(int(routing.offsets[e]), int(routing.offsets[e + 1]))
                recompute_and_differentiate(Tile(e, rows, slice(0, f), 0, 0.0))
                input_grad(Tile(e, rows, slice(0, d), 0, 0.0))
                if lora is not None:
                    lora_grads(e)

            order = sorted(active.tolist(), key=lambda e: -routing.sizes[e])
            self._run_tasks(stats, layer, [lambda e=e: expert(e) for e in order])
            stats.flops += 2.0 * p * (phase_width + 2 * d) * f
            stats.weight_bytes += len(active) * (phase_width + 2 * d) * f * w.bytes_per_weight
        else:
            tiles2 = plan_tiles(routing, d, self.threads)
            lora_tasks = [lambda e=e: lora_grads(e) for e in (active.tolist() if lora is not None else ())]
            self._run_tasks(stats, layer, [lambda t=t: input_grad(t) for t in tiles2] + lora_tasks)
            stats.flops += sum(2 * (t.rows.stop - t.rows.start) * 2 * f * (t.cols.stop - t.cols.start) for t in tiles2)
            stats.weight_bytes += sum(2 * f * (t.cols.stop - t.cols.start) for t in tiles2) * w.bytes_per_weight

        dx = self._combine(stats, layer, dx_s, routing)
        dweights = np.zeros(ids_tk.size, np.float32)
        dweights[routing.order] = dw_blocks.sum(axis=1)
        stats.wall_s = time.perf_counter() - start
        self.last_stats = stats
        return dx, dweights.reshape(ids_tk.shape), grads

    def _rows_plus_zero_row(self, name: str, rows: int, width: int) -> np.ndarray:
        """[rows + 1, width] float32 from the workspace (aligned rows for the GEMMs that write them), the extra
        row zero: where pairs not routed here point."""
        buffer = self.workspace.get(name, (rows + 1, width), np.float32)
        buffer[rows] = 0.0
        return buffer

    # ---------------------------------------------------------------- running tiles
    def _run(self, stats: CallStats, layer: int, tiles: list[Tile], fn, w: LayerExperts, phase_width: int):
        """Runs `fn` over tiles; counts FLOPs as rows x phase_width x tile columns x 2 and the weights read."""
        self._run_tasks(stats, layer, [lambda t=t: fn(t) for t in tiles])
        for t in tiles:
            cols = t.cols.stop - t.cols.start
            stats.flops += 2.0 * (t.rows.stop - t.rows.start) * phase_width * cols
            stats.weight_bytes += phase_width * cols * w.bytes_per_weight

    def _run_tasks(self, stats: CallStats, layer: int, tasks):
        try:
            stats.add_busy(self.pool.run(tasks))
        except HostKernelError:
            raise
        except Exception as e:
            raise HostKernelError(f"layer {layer}: host expert kernel failed: {type(e).__name__}: {e}") from e


@dataclass
class SavedActivations:
    """Gate/up pre-activations of one forward call, in expert-sorted pair order ([pairs, 2f])."""

    layer: int
    ids_tk: np.ndarray
    h: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.h.nbytes


def _gate_up(mm, lora: ExpertLoRA | None, tile: Tile, x, rows, bias=None):
    """Gate and up pre-activations of one tile's rows (`x[rows]`, or `x` when rows is None) and ffn columns,
    with the experts' biases (`bias`: the layer's [experts, 2 ffn]) and LoRA when given."""
    e, cols = tile.expert, tile.cols
    hg, hu = mm.gate_up(e, x, rows, cols)
    if bias is not None:
        f = bias.shape[1] // 2
        hg += bias[e, cols]
        hu += bias[e, f + cols.start : f + cols.stop]
    if lora is not None:
        x_rd = x if rows is None else x[rows]
        for pair, h in ((lora.gate, hg), (lora.up, hu)):
            if pair is not None:
                h += lora.scale * ((x_rd @ pair[0][e]) @ pair[1][e][:, cols])
    return hg, hu


def _lora_grads(e, routing: Routing, lora: ExpertLoRA, grads: ExpertLoRA, x_s, dy_s, weight_s, dh, act, f):
    rows = slice(int(routing.offsets[e]), int(routing.offsets[e + 1]))
    s = lora.scale
    for name, inputs, d_out in (("gate", x_s[rows], dh[rows, :f]), ("up", x_s[rows], dh[rows, f:])):
        pair = getattr(lora, name)
        if pair is not None:
            a, b = pair
            grad_a, grad_b = getattr(grads, name)
            grad_b[e] = s * ((inputs @ a[e]).T @ d_out)
            grad_a[e] = s * (inputs.T @ (d_out @ b[e].T))
    if lora.down is not None:
        a, b = lora.down
        grad_a, grad_b = grads.down
        d_out = dy_s[rows] * weight_s[rows, None]
        grad_b[e] = s * ((act[rows] @ a[e]).T @ d_out)
        grad_a[e] = s * (act[rows].T @ (d_out @ b[e].T))


def _check_activations(layer: int, what: str, array, shape) -> np.ndarray:
    array = np.asarray(array)
    if array.shape != tuple(shape):
        raise HostKernelError(f"layer {layer}: {what} has shape {array.shape}, expected {tuple(shape)}")
    if array.dtype != np.float32:
        raise HostKernelError(f"layer {layer}: {what} must be float32, got {array.dtype}")
    if not np.isfinite(array).all():
        bad = np.argwhere(~np.isfinite(array))[0]
        raise NonFiniteError(f"layer {layer}: {what} has a non-finite value {array[tuple(bad)]} at {tuple(bad)}")
    return np.ascontiguousarray(array)


def _check_inputs(layer: int, w: LayerExperts, x_td, ids_tk, weights_tk, lora):
    x_td = np.asarray(x_td)
    if x_td.ndim != 2 or x_td.shape[1] != w.hidden:
        raise HostKernelError(f"layer {layer}: activations have shape {x_td.shape}, expected [tokens, {w.hidden}]")
    x_td = _check_activations(layer, "activations", x_td, x_td.shape)
    ids_tk = check_expert_ids(layer, ids_tk, x_td.shape[0], w.num_experts)
    weights_tk = _check_activations(layer, "routing weights", weights_tk, ids_tk.shape)
    if lora is not None:
        lora.validate(layer, w.num_experts, w.hidden, w.ffn)
    return x_td, ids_tk.astype(np.int64), weights_tk
