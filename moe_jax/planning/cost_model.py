"""The cost model: how long one MoE layer takes for a routing, under a placement, from a probe profile.

How it works and why: docs/INTERNALS.md, moe_jax/planning/cost_model.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_jax.errors import InputError

PLACES = ("host", "resident", "stream")
# a device that shares the host's cores must be measured this much faster than the host at some size before it
# is used: at decode sizes two probes of the same machine differ by up to ~20%
SHARED_DEVICE_MARGIN = 1.25


@dataclass(frozen=True)
class Profile:
    expert_bytes: float
    bus_gbps: float
    bus_gbps_shared: float  # while the host lane also reads RAM
    host_rows: np.ndarray
    host_seconds: np.ndarray
    device_rows: np.ndarray
    device_seconds: np.ndarray
    host_call_s: float = 0.0  # fixed cost of one host call (dispatch, routing, combine), beyond its experts
    device_call_s: float = 0.0
    host_workers: int = 1  # threads the host times were measured with
    # False where the "device" is the host's own CPU (jax on CPU): the lanes then share cores and add up
    parallel_lanes: bool = True
    callback_s: float = 0.0  # one host callback's round trip from a jitted step (the pipeline's start or finish)
    # the device's plain products of rows with a weight of one expert's size (None: not probed; the device's
    # expert table stands in)
    dense_rows: np.ndarray | None = None
    dense_seconds: np.ndarray | None = None

    @classmethod
    def load(cls, path) -> Profile:
        try:
            p = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise InputError(f"{path}: no probe profile (write one with `python -m moe_jax.probe`)") from None
        return cls.from_dict(p)

    @classmethod
    def from_dict(cls, p: dict) -> Profile:
        """From the probe's JSON object (`probe.measure`)."""
        both = p.get("both", {}).get("bus_gbps") or p["bus"]["gbps"]
        return cls(
            float(p["expert"]["bytes"]),
            float(p["bus"]["gbps"]),
            float(both),
            np.array([r["rows"] for r in p["host"]], float),
            np.array([r["seconds"] for r in p["host"]], float),
            np.array([r["rows"] for r in p["device"]], float),
            np.array([r["seconds"] for r in p["device"]], float),
            float(p.get("host_call_s", 0.0)),
            float(p.get("device_call_s", 0.0)),
            int(p.get("host_threads", 1)),
            bool(p.get("parallel_lanes", True)),
            float(p.get("callback_s", 0.0)),
            np.array([r["rows"] for r in p["device_dense"]], float) if "device_dense" in p else None,
            np.array([r["seconds"] for r in p["device_dense"]], float) if "device_dense" in p else None,
        )

    def host_time(self, rows):
        """Host seconds for one expert with `rows` rows (a number or an array of them)."""
        return _plain(_interpolate(self.host_rows, self.host_seconds, np.asarray(rows, float)))

    def device_time(self, rows):
        return _plain(_interpolate(self.device_rows, self.device_seconds, np.asarray(rows, float)))

    def dense_time(self, rows):
        """Device seconds of `rows` rows through a plain product with a weight of one expert's size."""
        if self.dense_rows is None:
            return self.device_time(rows)
        return _plain(_interpolate(self.dense_rows, self.dense_seconds, np.asarray(rows, float)))

    def for_dtype(self, itemsize: int) -> Profile:
        """The profile for weights of `itemsize` bytes (the probe measures float32): copies move fewer bytes.
        Compute times are kept as measured."""
        return dataclasses.replace(self, expert_bytes=self.expert_bytes * itemsize / 4)

    def with_bus(self, gbps: float) -> Profile:
        """The same host and device timings behind a bus of `gbps` (the shared-RAM slowdown kept in proportion):
        a simulated machine whose device is a separate chip, so its lanes run in parallel."""
        shared = gbps * self.bus_gbps_shared / self.bus_gbps
        return dataclasses.replace(self, bus_gbps=gbps, bus_gbps_shared=shared, parallel_lanes=True)

    @property
    def device_helps(self) -> bool:
        """Whether placing experts on the device can pay: it runs beside the host (a separate chip), or it
        computes an expert clearly faster than the host (by SHARED_DEVICE_MARGIN) at some measured size. Not so
        for jax on the host's own CPU, whose decode-size timings differ from the host's by probe noise."""
        faster = self.device_time(self.host_rows) * SHARED_DEVICE_MARGIN < self.host_seconds
        return self.parallel_lanes or bool(np.any(faster))


def _plain(values):
    return float(values) if np.ndim(values) == 0 else values


def _interpolate(rows_table, seconds_table, rows, xp=np):
    """Linear between measured sizes (time is affine in rows within a regime), extrapolated by the last slope;
    zero rows cost nothing. `xp` is numpy or jax.numpy (the planner also runs inside jit)."""
    slope = (seconds_table[-1] - seconds_table[-2]) / (rows_table[-1] - rows_table[-2])
    beyond = seconds_table[-1] + slope * (rows - rows_table[-1])
    inside = xp.interp(rows, xp.asarray(rows_table), xp.asarray(seconds_table))
    return xp.where(rows <= 0, 0.0, xp.where(rows > rows_table[-1], beyond, inside))


def _host_lane(profile: Profile, host_s, rows, on_host, xp=np):
    """Host lane of the experts masked by `on_host` (leading axes: alternatives). The per-expert seconds were
    measured with every worker busy, but work spreads over the workers in whole tiles, cut as
    host_kernels.schedule cuts them (by rows in half-share pieces from 64 rows, else by columns when bigger than
    a share), so 5 equal tiles on 2 workers take 3 tiles' time, not 2.5."""
    workers = profile.host_workers
    seconds = xp.sum(xp.where(on_host, host_s, 0.0), axis=-1)
    share = xp.maximum(seconds / workers, 1e-12)[..., None]
    by_rows = xp.minimum(xp.ceil(host_s / (share / 2)), xp.floor(rows / 32))
    by_cols = xp.minimum(xp.ceil(host_s / share), workers)
    pieces = xp.where((rows >= 64) & (host_s > share / 2), by_rows, by_cols)
    pieces = xp.maximum(pieces, 1.0)
    tiles = xp.sum(xp.where(on_host, pieces, 0.0), axis=-1)
    # equal tiles leave the last round part-filled; largest-first, that last round holds the smallest tiles
    spread = xp.ceil(tiles / workers) * workers / xp.maximum(tiles, 1.0) - 1.0
    smallest = xp.min(xp.where(on_host, host_s / pieces, xp.inf), axis=-1)
    smallest = xp.where(tiles > 0, smallest, 0.0)
    smallest_over_mean = xp.where(tiles > 0, smallest * tiles / xp.maximum(seconds, 1e-12), 1.0)
    return xp.where(tiles > 0, seconds * (1.0 + spread * smallest_over_mean) + profile.host_call_s, 0.0)


@dataclass(frozen=True)
class LayerTime:
    host_lane: float
    device_lane: float
    parallel: bool = True  # the lanes overlap (a separate device) or add up (one CPU for both)

    @property
    def seconds(self) -> float:
        return max(self.host_lane, self.device_lane) if self.parallel else self.host_lane + self.device_lane


def _bus_seconds(profile: Profile, copies, host_lane, xp=np):
    """Seconds to copy `copies` experts back to back from t=0: at the shared bandwidth while the host lane reads
    RAM (until `host_lane`), at the full bandwidth after."""
    nbytes = copies * profile.expert_bytes
    shared_bps, full_bps = profile.bus_gbps_shared * 1e9, profile.bus_gbps * 1e9
    moved_while_shared = host_lane * shared_bps
    return xp.where(
        nbytes <= moved_while_shared, nbytes / shared_bps, host_lane + (nbytes - moved_while_shared) / full_bps
    )


def _device_lane(profile: Profile, resident_s, device_s, streamed, host_lane, xp=np):
    """Device lane: the fixed call cost and the resident experts first, then the experts masked by `streamed`,
    copied back to back in the order given and each computed once its copy lands (a two-stage flow shop: the
    lane ends at the latest of, over streamed experts i, the i-th copy's arrival plus the compute from i on),
    into two buffers.
    `device_s` are the experts' device seconds; leading axes are alternatives."""
    mine = xp.where(streamed, device_s, 0.0)
    after = xp.cumsum(mine, axis=-1)
    streamed_s = after[..., -1]
    compute = resident_s + streamed_s
    compute = xp.where(compute > 0, compute + profile.device_call_s, 0.0)
    arrival = _bus_seconds(profile, xp.cumsum(streamed, axis=-1), host_lane[..., None], xp)
    from_here = streamed_s[..., None] - (after - mine)  # compute of this expert and the ones after it
    waits = xp.max(xp.where(streamed, arrival + from_here, 0.0), axis=-1)
    # two buffers: while expert i computes, only copy i + 1 can be in flight, so each step takes the longer of
    # expert i's compute and copy i + 1
    count = xp.sum(streamed, axis=-1)
    index = xp.cumsum(streamed, axis=-1)  # 1-based position among the streamed experts
    next_copy = _bus_seconds(profile, index + 1, host_lane[..., None], xp) - arrival
    next_copy = xp.where(index < count[..., None], next_copy, 0.0)
    steps = xp.sum(xp.where(streamed, xp.maximum(device_s, next_copy), 0.0), axis=-1)
    buffered = xp.where(count > 0, _bus_seconds(profile, 1, host_lane, xp) + steps, 0.0)
    return xp.maximum(xp.maximum(compute, waits), buffered)


def layer_time(profile: Profile, tokens_per_expert, placement) -> LayerTime:
    """Predicted time of one layer: `placement[e]` in PLACES for each expert e."""
    n = np.asarray(tokens_per_expert, float)
    place = np.asarray(placement)
    if not set(place.tolist()) <= set(PLACES):
        raise InputError(f"placement {sorted(set(place.tolist()) - set(PLACES))} not in {PLACES}")
    host_s, device_s = profile.host_time(n), profile.device_time(n)
    host = float(_host_lane(profile, host_s, n, (place == "host") & (n > 0)))
    resident_s = device_s[place == "resident"].sum()
    order = np.argsort(-device_s, stable=True)  # streamed longest first: the quickest after the last copy
    streamed = (place == "stream") & (n > 0)
    device = _device_lane(profile, resident_s, device_s[order], streamed[order], np.asarray(host))
    return LayerTime(host, float(device), profile.parallel_lanes)


def best_placement(profile: Profile, tokens_e, resident_e, can_stream=True, *, xp=np):
    """The planner's core, shared by the cost model (numpy) and the running backend (jax.numpy, inside jit).

    Every routed expert computes on the host or on the device: from the device cache when it is resident there
    (an option, not an obligation: at sizes where the host is faster its rows go to the host), else streamed
    over the bus (when `can_stream`). Moving an expert to the device lane saves its host time at the price of its
    device time (plus one copy when streamed). When the device lane binds, the experts to move first are those
    that save the most host time per device-lane second added; when the host lane binds, those that save the most
    host time (the busiest); the third ranking keeps the cache's experts first (the placement of a static cache).
    The best set is nearly always a prefix of one of these: all 3 (E + 1) prefixes are scored at once and the
    fastest is returned as (k, ranking): the first k experts of the ranking compute on the device, the other
    routed experts on the host. k = 0 is every routed expert on the host, so the plan never loses to it."""
    tokens_e = xp.asarray(tokens_e, dtype=xp.float32)
    host_s = _interpolate(profile.host_rows, profile.host_seconds, tokens_e, xp)
    device_s = _interpolate(profile.device_rows, profile.device_seconds, tokens_e, xp)
    candidate = (tokens_e > 0) & (resident_e | can_stream)
    copy_s = xp.where(resident_e, 0.0, _bus_seconds(profile, 1, 0.0, xp))
    per_device_second = host_s / xp.maximum(device_s + copy_s, 1e-12)
    by_rate, by_host = (xp.argsort(xp.where(candidate, -key, 1.0), stable=True) for key in (per_device_second, host_s))
    cache_first = by_rate[xp.argsort(xp.where(candidate & resident_e, 0, 1)[by_rate], stable=True)]
    rankings = xp.stack([by_rate, by_host, cache_first])
    seconds = xp.stack(
        [_prefix_seconds(profile, host_s, device_s, tokens_e, candidate, resident_e, r, xp) for r in rankings]
    )
    best = xp.argmin(seconds)
    experts = tokens_e.shape[0] + 1
    return best % experts, rankings[best // experts]


def _prefix_seconds(profile, host_s, device_s, tokens_e, candidate, resident_e, order, xp):
    """Layer seconds when the first k experts of `order` compute on the device, for k = 0..E (inf past the
    candidates)."""
    e = tokens_e.shape[0]
    valid = xp.cumsum(candidate[order]) == xp.arange(1, e + 1)
    k = xp.arange(e + 1)
    on_device = (xp.arange(e)[None, :] < k[:, None]) & valid[None, :]
    streamed = on_device & ~resident_e[order][None, :]
    on_host = (tokens_e[order] > 0)[None, :] & ~on_device
    host_lane = _host_lane(profile, host_s[order][None, :], tokens_e[order][None, :], on_host, xp)
    resident_s = xp.sum(xp.where(on_device & ~streamed, device_s[order][None, :], 0.0), axis=-1)
    device_lane = _device_lane(profile, resident_s, device_s[order][None, :], streamed, host_lane, xp)
    feasible = xp.concatenate([xp.ones(1, dtype=bool), valid])
    layer = xp.maximum(host_lane, device_lane) if profile.parallel_lanes else host_lane + device_lane
    return xp.where(feasible, layer, xp.inf)


def plan_layer(
    profile: Profile, tokens_per_expert, resident: set[int] | frozenset = frozenset(), can_stream: bool = True
) -> list[str]:
    """A placement for one layer: each routed expert "resident" (computed from the device cache; only experts in
    `resident` can be), "stream" or "host", as `best_placement` finds fastest."""
    tokens = np.asarray(tokens_per_expert, float)
    resident_e = np.isin(np.arange(len(tokens)), list(resident))
    k, order = best_placement(profile, tokens, resident_e, can_stream)
    placement = ["host"] * len(tokens)
    for e in order[: int(k)]:
        placement[int(e)] = "resident" if resident_e[e] else "stream"
    return placement
