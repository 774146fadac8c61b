"""A discrete-event simulation of one MoE layer's two lanes, to check the planner where no accelerator is at hand.

How it works and why: docs/INTERNALS.md, moe_jax/planning/simulate.py.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import numpy as np

from moe_jax.planning.auto_choice import choose_auto
from moe_jax.planning.cost_model import Profile, plan_layer
from moe_jax.planning.model_shape import Shape

HYBRID_FRACTIONS = (0.25, 0.5, 0.75)
# the validation sweep: bus bandwidth, tokens per step, routing skew
BUS_GBPS = (4, 8, 16, 32, 64)
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192)
SKEWS = (0.0, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class SimResult:
    seconds: float
    host_lane: float
    device_lane: float
    bus_busy: float


def _host_lane(profile: Profile, rows: list[float], workers: int) -> float:
    """List scheduling of tiles on `workers` threads, largest first, tiles cut as host_kernels.schedule cuts them:
    by rows in pieces of about half a worker's share (64+ rows), else by columns when bigger than a share. The
    profile's per-expert seconds were measured with every worker busy: on one worker a piece takes W times its
    share of them."""
    if not rows:
        return 0.0
    tasks = []
    seconds = [profile.host_time(n) for n in rows]
    share = sum(seconds) / workers
    for n, t in zip(rows, seconds, strict=True):
        if n >= 64 and t > share / 2:  # by rows, in pieces of about half a share
            pieces = min(int(np.ceil(t / (share / 2))), int(n) // 32)
        else:  # by columns, only when bigger than a whole share
            pieces = min(int(np.ceil(t / share)), workers)
        tasks += [t * workers / max(pieces, 1)] * max(pieces, 1)
    finish = [0.0] * workers
    for task in sorted(tasks, reverse=True):
        heapq.heappush(finish, heapq.heappop(finish) + task)
    return profile.host_call_s + max(finish)


def _copy_end(start: float, nbytes: float, host_end: float, shared_bps: float, full_bps: float) -> float:
    """When a copy begun at `start` lands: shared bandwidth until the host lane ends, full bandwidth after."""
    if start < host_end:
        shared_part = (host_end - start) * shared_bps
        if nbytes <= shared_part:
            return start + nbytes / shared_bps
        return host_end + (nbytes - shared_part) / full_bps
    return start + nbytes / full_bps


def simulate_layer(profile: Profile, tokens_per_expert, placement) -> SimResult:
    tokens = [float(n) for n in tokens_per_expert]
    host_rows = [n for n, p in zip(tokens, placement, strict=True) if p == "host" and n > 0]
    host_end = _host_lane(profile, host_rows, profile.host_workers)
    resident = [profile.device_time(n) for n, p in zip(tokens, placement, strict=True) if p == "resident" and n > 0]
    # streamed in decreasing compute time, so the expert computed after the last copy is the quickest
    streamed = sorted(
        (profile.device_time(n) for n, p in zip(tokens, placement, strict=True) if p == "stream" and n > 0),
        reverse=True,
    )
    device_free = profile.device_call_s + sum(resident) if (resident or streamed) else 0.0
    shared_bps, full_bps = profile.bus_gbps_shared * 1e9, profile.bus_gbps * 1e9
    bus_free, bus_busy = 0.0, 0.0
    compute_end: list[float] = []
    for i, compute in enumerate(streamed):
        buffer_free = compute_end[i - 2] if i >= 2 else 0.0  # two buffers: wait for the expert two back
        start = max(bus_free, buffer_free)
        landed = _copy_end(start, profile.expert_bytes, host_end, shared_bps, full_bps)
        bus_busy += landed - start
        bus_free = landed
        device_free = max(device_free, landed) + compute
        compute_end.append(device_free)
    # a "device" on the host's own cores (jax on CPU) does not run beside the host: the lanes add up
    seconds = max(host_end, device_free) if profile.parallel_lanes else host_end + device_free
    return SimResult(seconds, host_end, device_free, bus_busy)


def static_placements(tokens_per_expert, resident=frozenset()) -> dict[str, list[str]]:
    """The hand-set choices: every expert on the host (the cache unused: backend="host"), every non-resident
    expert on the host, all of them streamed, and streaming a fixed fraction of the routed ones (the busiest)."""
    tokens = np.asarray(tokens_per_expert)
    base = ["resident" if e in resident else "host" for e in range(len(tokens))]
    routed = [int(e) for e in np.argsort(-tokens, stable=True) if tokens[e] > 0 and e not in resident]
    out = {"host-only": ["host"] * len(tokens), "all-host": base}
    for name, fraction in [("all-offload", 1.0)] + [(f"hybrid-{int(f * 100)}%", f) for f in HYBRID_FRACTIONS]:
        placement = base.copy()
        for e in routed[: int(round(fraction * len(routed)))]:
            placement[e] = "stream"
        out[name] = placement
    return out


def compare_with_statics(profile: Profile, tokens_per_expert, resident=frozenset(), use_device=True) -> dict:
    """Simulated seconds of auto's placement (the planner's, or every expert on the host where auto's rule,
    `use_device`, keeps the device out) and of each static one."""
    if use_device:
        planned = plan_layer(profile, tokens_per_expert, resident)
    else:
        planned = ["host"] * len(tokens_per_expert)
    times = {"planner": simulate_layer(profile, tokens_per_expert, planned).seconds}
    for name, placement in static_placements(tokens_per_expert, resident).items():
        times[name] = simulate_layer(profile, tokens_per_expert, placement).seconds
    return times


def zipf_routing(rng: np.random.Generator, tokens: int, experts: int, top_k: int, skew: float) -> np.ndarray:
    """Tokens per expert for `tokens` tokens routed top-k over experts of Zipf popularity (skew 0: uniform),
    the popular experts at random ids."""
    popularity = 1.0 / np.arange(1, experts + 1) ** skew
    popularity = popularity[rng.permutation(experts)]
    # Gumbel top-k: the k largest of log p + Gumbel noise are a draw of k experts without replacement
    scores = np.log(popularity / popularity.sum()) + rng.gumbel(size=(tokens, experts))
    chosen = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return np.bincount(chosen.ravel(), minlength=experts)


def sweep(
    profile: Profile, experts: int, top_k: int, seed: int = 0, cached: int = 0, shared_cores: bool = False
) -> list[dict]:
    """The planner against the static choices at every point of the sweep, one row per point. `cached`: experts
    in the device cache (the most routed of each point); `shared_cores`: the device is the host's own CPU (its
    lanes add up, as jax on CPU does)."""
    rng = np.random.default_rng(seed)
    rows = []
    shape = Shape(1, experts, top_k, int(profile.expert_bytes) // 4, 4)
    for gbps in BUS_GBPS:
        bus = profile.with_bus(gbps)
        if shared_cores:
            bus = dataclasses.replace(bus, parallel_lanes=False)
        use_device = choose_auto(bus, shape, cached, True, TOKENS).use_device
        for tokens in TOKENS:
            for skew in SKEWS:
                counts = zipf_routing(rng, tokens, experts, top_k, skew)
                resident = frozenset(np.argsort(-counts, stable=True)[:cached].tolist())
                times = compare_with_statics(bus, counts, resident, use_device)
                statics = {k: v for k, v in times.items() if k != "planner"}
                best = min(statics, key=statics.get)
                rows.append(
                    {
                        "bus_gbps": gbps,
                        "tokens": tokens,
                        "zipf": skew,
                        "planner_ms": times["planner"] * 1e3,
                        "best_static": best,
                        "best_static_ms": statics[best] * 1e3,
                        "planner_over_best": times["planner"] / statics[best],
                        **{f"over_{k}": times["planner"] / v for k, v in statics.items()},
                    }
                )
    return rows


def summarise(rows: list[dict]) -> dict:
    """Worst and mean planner / best static, and how often the planner is strictly faster than each static."""
    ratios = np.array([r["planner_over_best"] for r in rows])
    statics = [k.removeprefix("over_") for k in rows[0] if k.startswith("over_")]
    return {
        "points": len(rows),
        "worst_planner_over_best_static": float(ratios.max()),
        "mean_planner_over_best_static": float(ratios.mean()),
        "planner_beats_best_static": int((ratios < 0.999).sum()),
        "planner_faster_than": {s: float(np.mean([r[f"over_{s}"] < 0.999 for r in rows])) for s in statics},
    }
