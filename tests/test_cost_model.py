"""The cost model and layer planner on a synthetic profile (no timing: the profile is given)."""

import json

import numpy as np
import pytest

from moe_jax.planning.cost_model import Profile, layer_time, plan_layer

ROWS = [1, 16, 256, 1024]


def profile(bus_gbps, host_per_row, device_per_row, fixed=1e-4, expert_bytes=8e6):
    return Profile(
        expert_bytes,
        bus_gbps,
        bus_gbps,
        np.array(ROWS, float),
        np.array([fixed + host_per_row * r for r in ROWS]),
        np.array(ROWS, float),
        np.array([device_per_row * r for r in ROWS]),
    )


def test_lanes_overlap_and_copies_double_buffer():
    p = profile(bus_gbps=8, host_per_row=1e-5, device_per_row=1e-6)
    t = layer_time(p, [100, 100, 0], ["host", "stream", "stream"])
    assert t.host_lane == pytest.approx(1e-4 + 1e-3)
    assert t.device_lane == pytest.approx(1e-3 + 1e-4)  # one copy (1 ms) plus its compute; the unused expert is free
    assert t.seconds == max(t.host_lane, t.device_lane)


def test_decode_stays_on_the_host_and_prefill_streams_when_the_bus_is_fast():
    slow_bus = profile(bus_gbps=4, host_per_row=2e-5, device_per_row=1e-7)
    fast_bus = profile(bus_gbps=64, host_per_row=2e-5, device_per_row=1e-7)
    decode, prefill = [2] * 8, [512] * 8
    assert plan_layer(slow_bus, decode) == ["host"] * 8  # a copy (2 ms) costs more than computing 2 rows
    plan = plan_layer(fast_bus, prefill)
    assert plan.count("stream") >= 4  # big batches: ship most experts to the device
    assert layer_time(fast_bus, prefill, plan).seconds < layer_time(fast_bus, prefill, ["host"] * 8).seconds


def test_resident_experts_are_kept_and_planner_never_worse_than_all_host():
    p = profile(bus_gbps=16, host_per_row=2e-5, device_per_row=1e-6)
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = rng.integers(0, 300, size=8).tolist()
        plan = plan_layer(p, tokens, resident={0, 3})
        assert plan[0] == plan[3] == "resident"
        baseline = ["resident" if e in (0, 3) else "host" for e in range(8)]
        assert layer_time(p, tokens, plan).seconds <= layer_time(p, tokens, baseline).seconds


def test_profile_loads_the_probe_json(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(
        json.dumps(
            {
                "expert": {"bytes": 1000},
                "bus": {"gbps": 5.0},
                "both": {"bus_gbps": 4.0},
                "host": [{"rows": r, "seconds": r * 1e-5} for r in ROWS],
                "device": [{"rows": r, "seconds": r * 1e-6} for r in ROWS],
            }
        )
    )
    p = Profile.load(path)
    assert (p.bus_gbps, p.bus_gbps_shared, p.expert_bytes) == (5.0, 4.0, 1000.0)
    assert p.host_time(8) == pytest.approx(8e-5) and p.host_time(2048) == pytest.approx(2048e-5)
