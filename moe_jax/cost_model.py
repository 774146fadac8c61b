"""The cost model: how long one MoE layer takes for a routing, under a placement, from a probe profile.

Each expert is computed in one of three places:
  host      on the host CPU by host_kernels, where its weights are (the host lane);
  resident  on the device from a cached copy (the device lane);
  stream    copied over the bus, then computed on the device (the device lane, copies double-buffered).
The two lanes run at once, so a layer takes the slower of them. Per-expert times come from the probe's tables
(`python -m moe_jax.probe`), interpolated in rows routed to the expert; copies take bytes / bus bandwidth, the
bandwidth measured while the host computes when both lanes are busy (they share RAM bandwidth).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_jax.errors import InputError

PLACES = ("host", "resident", "stream")


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

    @classmethod
    def load(cls, path) -> Profile:
        try:
            p = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise InputError(f"{path}: no probe profile (write one with `python -m moe_jax.probe`)") from None
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
        )

    def host_time(self, rows: float) -> float:
        return _interpolate(self.host_rows, self.host_seconds, rows)

    def device_time(self, rows: float) -> float:
        return _interpolate(self.device_rows, self.device_seconds, rows)

    def copy_time(self, shared: bool) -> float:
        return self.expert_bytes / ((self.bus_gbps_shared if shared else self.bus_gbps) * 1e9)


def _interpolate(rows_table: np.ndarray, seconds_table: np.ndarray, rows: float) -> float:
    """Linear between measured sizes (time is affine in rows within a regime), extrapolated by the last slope."""
    if rows <= 0:
        return 0.0
    if rows >= rows_table[-1]:
        slope = (seconds_table[-1] - seconds_table[-2]) / (rows_table[-1] - rows_table[-2])
        return float(seconds_table[-1] + slope * (rows - rows_table[-1]))
    return float(np.interp(rows, rows_table, seconds_table))


@dataclass(frozen=True)
class LayerTime:
    host_lane: float
    device_lane: float

    @property
    def seconds(self) -> float:
        return max(self.host_lane, self.device_lane)


def layer_time(profile: Profile, tokens_per_expert, placement) -> LayerTime:
    """Predicted time of one layer: `placement[e]` in PLACES for each expert e."""
    host = sum(profile.host_time(n) for n, p in zip(tokens_per_expert, placement, strict=True) if p == "host")
    host += profile.host_call_s if host else 0.0
    compute = [profile.device_time(n) for n, p in zip(tokens_per_expert, placement, strict=True) if p != "host" and n]
    if compute:
        compute[0] += profile.device_call_s
    streamed = sum(1 for n, p in zip(tokens_per_expert, placement, strict=True) if p == "stream" and n)
    copy = profile.copy_time(shared=host > 0)
    if streamed:  # double buffering: copies overlap compute; the first copy and the last compute do not
        device = max(streamed * copy + min(compute), sum(compute) + copy)
    else:
        device = sum(compute)
    return LayerTime(host, device)


def plan_layer(profile: Profile, tokens_per_expert, resident: set[int] | frozenset = frozenset()) -> list[str]:
    """A placement for one layer: experts in `resident` (cached on the device) compute there; every other expert
    goes to the host or is streamed, greedily moving the expert that most shortens the layer from the host lane
    to streaming while that helps."""
    placement = ["resident" if e in resident else "host" for e in range(len(tokens_per_expert))]
    best = layer_time(profile, tokens_per_expert, placement).seconds
    while True:
        candidates = []
        for e, place in enumerate(placement):
            if place != "host" or not tokens_per_expert[e]:
                continue
            trial = placement.copy()
            trial[e] = "stream"
            candidates.append((layer_time(profile, tokens_per_expert, trial).seconds, e))
        if not candidates:
            return placement
        seconds, e = min(candidates)
        if seconds >= best:
            return placement
        placement[e], best = "stream", seconds
