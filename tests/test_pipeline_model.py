"""The whole-step timeline model (planning/pipeline_model.py): the two lanes overlap across micro-batches only
beside a separate device; callbacks and smaller host calls are paid for; the plan follows a profile."""

import dataclasses

import numpy as np
import pytest

from moe_jax.planning.cost_model import Profile
from moe_jax.planning.model_shape import Shape, StepShape
from moe_jax.planning.pipeline_model import best_micro_batches, plan_with_profile, serial_step, step_timeline
from moe_jax.planning.plan import make_plan

ROWS = np.array([1.0, 16.0, 256.0, 4096.0])
# 8 experts of 1M params, top-2, 4 MoE layers; the device's own work per token about one expert's
STEP = StepShape(Shape(4, 8, 2, 1_000_000, 2), 4, 1024, 1_000_000)


def profile(host_per_row=0.5e-5, device_per_row=1e-5, callback_s=0.0, parallel=True) -> Profile:
    """Linear lanes (seconds proportional to rows; the host, with two experts a token, as busy as the device),
    a fast bus."""
    return Profile(
        2e6,
        1e3,
        1e3,
        ROWS,
        ROWS * host_per_row,
        ROWS,
        ROWS * device_per_row,
        callback_s=callback_s,
        parallel_lanes=parallel,
    )


def test_balanced_lanes_overlap_across_micro_batches():
    p = profile()
    plain = step_timeline(p, STEP, 8, 128, 1)
    assert plain.seconds == pytest.approx(plain.device_busy_s + plain.host_busy_s)  # one after the other
    two, four = (step_timeline(p, STEP, 8, 128, m) for m in (2, 4))
    assert two.seconds < 0.8 * plain.seconds and four.seconds < two.seconds
    for timeline in (two, four):  # never below either lane's own work
        assert timeline.seconds >= max(timeline.device_busy_s, timeline.host_busy_s) - 1e-12
        assert timeline.device_busy + timeline.host_busy > 1.2  # both lanes busy at once part of the time
    assert best_micro_batches(p, STEP, 8, 128).micro_batches == 4
    assert best_micro_batches(p, STEP, 1, 128).micro_batches == 1  # one row is never split


def test_shared_cores_never_pipeline():
    p = profile(parallel=False)
    for m in (1, 2, 4):
        t = step_timeline(p, STEP, 8, 128, m)
        assert t.seconds == pytest.approx(t.device_busy_s + t.host_busy_s)
    assert best_micro_batches(p, STEP, 8, 128).micro_batches == 1


def test_callbacks_and_a_lopsided_step_keep_it_plain():
    costly = profile(callback_s=0.05)
    assert best_micro_batches(costly, STEP, 8, 128).micro_batches == 1
    host_bound = profile(host_per_row=1e-3)  # the device's share is too small to hide anything worth it
    assert best_micro_batches(host_bound, STEP, 8, 128).micro_batches == 1
    training = step_timeline(profile(), STEP, 8, 128, 2, training=True)
    assert training.seconds == pytest.approx(3 * step_timeline(profile(), STEP, 8, 128, 2).seconds)


def test_serial_steps_of_the_other_options():
    p = profile(callback_s=1e-3)
    experts = 0.01
    with_host = serial_step(p, STEP, 8, 128, experts)
    without = serial_step(p, STEP, 8, 128, experts, host_lane=False)
    activations = 2 * 8 * 128 * STEP.hidden * 2 / 1e12
    assert with_host - without == pytest.approx(STEP.experts.layers * 1e-3 + STEP.layers * activations)
    assert serial_step(p, STEP, 8, 128, experts, training=True) == pytest.approx(3 * with_host)


def test_the_plan_follows_a_profile_beside_an_accelerator():
    plan = make_plan("bfloat16", np.float32, pipeline=2)
    balanced = plan_with_profile(plan, profile(), STEP)
    assert balanced.micro_batches == 4
    assert balanced.decode_micro_batches == best_micro_batches(profile(), STEP, 16, 1).micro_batches
    slow_callbacks = plan_with_profile(plan, profile(callback_s=1.0), STEP)
    assert (slow_callbacks.micro_batches, slow_callbacks.decode_micro_batches) == (1, 1)
    assert "predicts 1 fastest" in slow_callbacks.reason("pipeline")
    assert dataclasses.replace(slow_callbacks, why=()).dtype == plan.dtype
