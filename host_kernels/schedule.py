"""Turning a routing into balanced work: expert-sorted pairs, and tiles sized by cost rather than by expert.

A tile is one expert's GEMM over a range of its (expert-sorted) rows and a range of output columns. A hot expert
is cut into several tiles so a skewed batch spreads over all workers: by rows when it has plenty (each piece stays
an efficient GEMM), by output columns when it has few (decode: the work is reading weights, and column ranges
split that reading evenly). Tiles come back largest first, the order in which the pool hands them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from host_kernels.errors import KernelArgumentError

NOT_ROUTED = -1  # an expert id meaning "this pair is computed elsewhere" (hybrid placement)


def check_expert_ids(layer: int, ids_tk, tokens: int, num_experts: int) -> np.ndarray:
    """Routing of `tokens` tokens as int32 [tokens, top_k >= 1], every id in [NOT_ROUTED, num_experts); an id of
    another dtype is refused, not cast (a float or an id above 2**31 would become another expert)."""
    ids_tk = np.asarray(ids_tk)
    if ids_tk.ndim != 2 or ids_tk.shape[0] != tokens or ids_tk.shape[1] < 1 or ids_tk.dtype.kind not in "iu":
        raise KernelArgumentError(
            f"layer {layer}: expert ids are {ids_tk.dtype} {ids_tk.shape}, expected integers [{tokens}, top_k >= 1]"
        )
    bad = (ids_tk < NOT_ROUTED) | (ids_tk >= num_experts)
    if bad.any():
        raise KernelArgumentError(
            f"layer {layer}: expert id {ids_tk[bad][0]} out of range [0, {num_experts}) "
            f"({NOT_ROUTED} marks a pair computed elsewhere)"
        )
    return np.ascontiguousarray(ids_tk, dtype=np.int32)


@dataclass(frozen=True)
class Routing:
    """The (token, slot) pairs of a batch that are routed here, ordered by expert."""

    order: np.ndarray  # [p] pair index (t * k + slot) at each sorted position
    token_of_pair: np.ndarray  # [p] token of each sorted pair
    sizes: np.ndarray  # [e] pairs routed to each expert
    offsets: np.ndarray  # [e + 1] start of each expert's rows in sorted order
    position: np.ndarray  # [t, k] sorted position of each pair; p (one past the end) for pairs not routed here

    @property
    def pairs(self) -> int:
        return self.order.size

    @classmethod
    def build(cls, ids_tk: np.ndarray, num_experts: int) -> Routing:
        flat = ids_tk.reshape(-1)
        routed = flat != NOT_ROUTED
        pairs = int(routed.sum())
        order = np.argsort(np.where(routed, flat, num_experts), kind="stable")[:pairs]
        sizes = np.bincount(flat[routed], minlength=num_experts)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        position = np.full(flat.size, pairs, dtype=np.int64)
        position[order] = np.arange(pairs)
        return cls(order, order // ids_tk.shape[1], sizes, offsets, position.reshape(ids_tk.shape))


@dataclass(frozen=True)
class Tile:
    expert: int
    rows: slice  # into expert-sorted pairs
    cols: slice  # output columns of this phase
    block: int  # which column block this is (0 when the columns are whole)
    cost: float


# Reading one expert's weights costs about as much as this many rows of GEMM on this class of CPU.
WEIGHT_READ_ROWS = 10
MIN_SPLIT_ROWS = 32  # below this a row split makes GEMMs too skinny: split columns instead
MIN_SPLIT_COLS = 64
COLUMN_ALIGN = 32  # column splits start on multiples of this: AMX tiles are 16 columns, cache lines 16 floats


def plan_tiles(routing: Routing, width: int, threads: int) -> list[Tile]:
    """Tiles covering every routed row of every expert, across `width` output columns."""
    sizes = routing.sizes
    active = np.flatnonzero(sizes)
    costs = sizes[active] + WEIGHT_READ_ROWS
    total = costs.sum()
    # Row splits: pieces of about half a worker's share, so the shared queue evens out what the cost estimate
    # misses. Column splits only for an expert bigger than a whole worker's share (decode with one hot expert):
    # cutting a GEMV into column blocks makes its weight reads strided, which costs more than it balances
    # (a split of decode-sized work costs more than it saves).
    row_share = total / (2 * threads) if threads > 1 else math.inf
    col_share = total / threads if threads > 1 else math.inf
    tiles = []
    for e, cost in zip(active.tolist(), costs.tolist(), strict=True):
        start, stop = int(routing.offsets[e]), int(routing.offsets[e + 1])
        rows = stop - start
        if rows >= 2 * MIN_SPLIT_ROWS and cost > row_share:
            parts = min(math.ceil(cost / row_share), rows // MIN_SPLIT_ROWS)
            bounds = np.linspace(start, stop, parts + 1).round().astype(int)
            for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):
                tiles.append(Tile(e, slice(int(r0), int(r1)), slice(0, width), 0, (r1 - r0) + WEIGHT_READ_ROWS / parts))
        else:
            parts = max(1, min(math.ceil(cost / col_share) if cost > col_share else 1, width // MIN_SPLIT_COLS))
            bounds = _column_bounds(width, parts)
            for j, (c0, c1) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                tiles.append(Tile(e, slice(start, stop), slice(int(c0), int(c1)), j, cost / parts))
    tiles.sort(key=lambda t: -t.cost)
    return tiles


def _column_bounds(width: int, parts: int) -> np.ndarray:
    """parts + 1 increasing bounds from 0 to width, the inner ones at multiples of COLUMN_ALIGN (parts is at most
    width // MIN_SPLIT_COLS, so no part comes out empty)."""
    inner = (np.linspace(0, width, parts + 1)[1:-1] / COLUMN_ALIGN).round().astype(int) * COLUMN_ALIGN
    return np.concatenate([[0], inner, [width]])


def max_column_blocks(tiles: list[Tile]) -> int:
    return max((t.block for t in tiles), default=0) + 1
