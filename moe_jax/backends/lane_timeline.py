"""Per-lane timestamps of pipelined steps: when the host computed which micro-batch's experts, and when the device
lane was free to compute (between the step's callbacks), so a run can show (and measure) their overlap.

How it works and why: docs/INTERNALS.md, moe_jax/backends/lane_timeline.py.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LaneEvent:
    lane: str  # "host" (expert work), "callback" (a pipeline callback on the device's stream)
    label: tuple  # e.g. ("forward", layer, micro_batch)
    start: float
    end: float
    opens_pass: bool = False  # the first callback of a forward or backward pass


class LaneTimeline:
    def __init__(self):
        self.events: list[LaneEvent] = []
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def add(self, lane: str, label: tuple, start: float, end: float, opens_pass: bool = False):
        with self._lock:
            self.events.append(LaneEvent(lane, tuple(label), start, end, opens_pass))

    @contextlib.contextmanager
    def recording(self, runtime):
        """Records `runtime`'s pipelined calls for the time of the block."""
        runtime.timeline = self
        try:
            yield self
        finally:
            runtime.timeline = None

    def host_intervals(self) -> list[tuple[float, float]]:
        return sorted((e.start, e.end) for e in self.events if e.lane == "host")

    def device_intervals(self) -> list[tuple[float, float]]:
        """The gaps between consecutive callbacks of a pass: when the device lane computed."""
        calls = sorted((e for e in self.events if e.lane == "callback"), key=lambda e: e.start)
        gaps = zip(calls, calls[1:], strict=False)
        return [(a.end, b.start) for a, b in gaps if not b.opens_pass and b.start > a.end]

    def summary(self) -> dict:
        """Seconds each lane was busy, and both at once; `overlap_of_host` is the share of the host's busy time
        during which the device lane computed too (0 for a step that runs the lanes one after the other)."""
        host, device = self.host_intervals(), self.device_intervals()
        host_s, device_s = _total(host), _total(device)
        both = _intersection(_merged(host), _merged(device))
        starts = [e.start for e in self.events] or [0.0]
        ends = [e.end for e in self.events] or [0.0]
        return {
            "span_s": max(ends) - min(starts),
            "host_busy_s": host_s,
            "device_busy_s": device_s,
            "both_busy_s": both,
            "overlap_of_host": both / host_s if host_s else 0.0,
            "host_calls": len(host),
        }

    def chrome_trace(self, path) -> Path:
        """The lanes as a Chrome trace (one row per lane, microseconds from the timeline's creation)."""
        rows = {"host": 1, "device": 2, "callback": 3}

        def span(name: str, lane: str, start: float, end: float) -> dict:
            ts, dur = (start - self.origin) * 1e6, (end - start) * 1e6
            return {"name": name, "ph": "X", "pid": 1, "tid": rows[lane], "ts": ts, "dur": dur}

        trace = [span(" ".join(map(str, e.label)), e.lane, e.start, e.end) for e in self.events]
        trace += [span("device", "device", a, b) for a, b in self.device_intervals()]
        trace += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"{lane} lane"}}
            for lane, tid in rows.items()
        ]
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": trace}))
        return path


def _total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(left, right) -> float:
    """Seconds covered by both of two sorted lists of disjoint intervals."""
    i = j = 0
    both = 0.0
    while i < len(left) and j < len(right):
        both += max(0.0, min(left[i][1], right[j][1]) - max(left[i][0], right[j][0]))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return both
