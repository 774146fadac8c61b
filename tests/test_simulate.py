"""The discrete-event layer simulation and the planner checked in it, with this machine's measured probe
profile (tests/data/probe_2core_cpu.json, from `python -m moe_jax.probe` on a 2-core CI machine)."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.planning.cost_model import Profile, best_placement
from moe_jax.planning.simulate import simulate_layer, static_placements, summarise, sweep

MEASURED = Profile.load(Path(__file__).parent / "data" / "probe_2core_cpu.json")
ROWS = np.array([1.0, 16.0, 256.0, 1024.0])


def flat_profile(bus_gbps=8.0, shared_gbps=None, host_per_row=1e-5, device_s=1e-3, expert_bytes=8e6):
    """Host time proportional to rows, a constant device time per expert: easy to reason about by hand."""
    return Profile(
        expert_bytes,
        bus_gbps,
        shared_gbps or bus_gbps,
        ROWS,
        ROWS * host_per_row,
        ROWS,
        np.full(4, device_s),
        host_workers=1,
    )


def test_one_streamed_expert_is_its_copy_then_its_compute():
    p = flat_profile()  # copy: 8e6 B / 8e9 B/s = 1 ms
    result = simulate_layer(p, [10, 0], ["stream", "host"])
    assert result.seconds == pytest.approx(2e-3) and result.bus_busy == pytest.approx(1e-3)
    assert result.host_lane == 0.0


def test_two_buffers_hold_the_third_copy_until_the_first_expert_is_computed():
    p = flat_profile(device_s=3e-3)
    # copies land at 1, 2 ms; the third may start only when expert 1 is done (1 + 3 = 4 ms), lands at 5 ms;
    # computes: 1-4, 4-7, 7-10 ms
    assert simulate_layer(p, [5, 5, 5], ["stream"] * 3).seconds == pytest.approx(10e-3)
    assert simulate_layer(p, [5, 5, 5], ["stream"] * 3).bus_busy == pytest.approx(3e-3)


def test_copies_slow_down_while_the_host_lane_reads_ram():
    p = flat_profile(bus_gbps=8.0, shared_gbps=4.0)
    # host lane: 100 rows x 10 us = 1 ms; the copy moves 4e6 B in that ms, the other 4e6 B at 8 GB/s: 1.5 ms
    result = simulate_layer(p, [100, 10], ["host", "stream"])
    assert result.host_lane == pytest.approx(1e-3)
    assert result.device_lane == pytest.approx(1.5e-3 + 1e-3)


def test_static_placements_stream_the_busiest_fraction():
    statics = static_placements([0, 40, 10, 30, 20], resident={4})
    assert statics["all-host"] == ["host", "host", "host", "host", "resident"]
    assert statics["all-offload"] == ["host", "stream", "stream", "stream", "resident"]
    assert statics["hybrid-25%"] == ["host", "stream", "host", "host", "resident"]
    assert statics["hybrid-75%"] == ["host", "stream", "host", "stream", "resident"]


@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8)])
def test_planner_within_5_percent_of_the_best_static_choice_over_the_sweep(experts, top_k):
    """Bus 4-64 GB/s x tokens 1-8192 x Zipf skew 0-2, with the measured host and device timings."""
    summary = summarise(sweep(MEASURED, experts, top_k))
    assert summary["worst_planner_over_best_static"] <= 1.05
    assert summary["planner_beats_best_static"] >= 0.2 * summary["points"]
    # usually better than each static choice (ties, where the static choice is the planner's, are not wins)
    assert np.mean(list(summary["planner_faster_than"].values())) >= 0.6


@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8)])
def test_planner_with_a_fast_device_stays_close_to_the_best_static_choice(experts, top_k):
    """The same sweep with device times divided by 200 (a stand-in for an accelerator). The closed-form host
    lane misjudges how a few decode-size experts spread over 2 workers by up to ~10%, so near the decode
    crossovers the planner can trail the best static split by that much; on average it is ahead."""
    fast = dataclasses.replace(
        MEASURED, device_seconds=MEASURED.device_seconds / 200, device_call_s=MEASURED.device_call_s / 200
    )
    summary = summarise(sweep(fast, experts, top_k))
    assert summary["worst_planner_over_best_static"] <= 1.10
    assert summary["mean_planner_over_best_static"] <= 1.0


def test_the_jitted_planner_chooses_what_the_numpy_one_does():
    p = MEASURED.with_bus(32)
    jitted = jax.jit(lambda counts, resident: best_placement(p, counts, resident, xp=jnp))
    rng = np.random.default_rng(1)
    streamed_somewhere = 0
    for _ in range(40):
        counts = rng.multinomial(int(rng.choice([2, 30, 500, 5000])), np.ones(8) / 8) * (rng.random(8) < 0.8)
        resident = rng.random(8) < 0.2
        k_jax, order_jax = jitted(counts, resident)
        k_np, order_np = best_placement(p, counts, resident)
        assert set(np.asarray(order_jax)[: int(k_jax)].tolist()) == set(order_np[: int(k_np)].tolist())
        streamed_somewhere += int(k_np) > 0
    assert 0 < streamed_somewhere < 40  # both outcomes were exercised
