"""Whether backend="auto" keeps a device expert cache (and streams) at all: the one rule that auto, the advisor and
the simulation share.

How it works and why: docs/INTERNALS.md, moe_jax/planning/auto_choice.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_jax.planning.cost_model import Profile, layer_time, plan_layer
from moe_jax.planning.model_shape import Shape, StepShape, expected_routing
from moe_jax.planning.pipeline_model import best_micro_batches, rows_and_length, serial_step

WORTH_IT = 1.10  # auto uses the device only when predicted this much faster than the host alone
# tokens per step of the phases a model meets: decode at batch 1 and 16, a prefill or training step
PHASES = (1, 16, 2048)


def auto_layer_seconds(profile: Profile, counts, cached: int, can_stream: bool) -> float:
    """Predicted seconds of one auto layer: the `cached` most routed experts in the device cache, the planner
    placing every expert per call."""
    resident = set(np.argsort(-np.asarray(counts), stable=True)[:cached].tolist())
    return layer_time(profile, counts, plan_layer(profile, counts, resident, can_stream)).seconds


def nearest_phase(tokens: int) -> int:
    """The phase a call of `tokens` tokens is closest to, on a log scale."""
    return min(PHASES, key=lambda phase: abs(np.log(max(tokens, 1)) - np.log(phase)))


def predicted_gain(
    profile: Profile, shape: Shape, cached: int, can_stream: bool, tokens: int, zipf: float = 0.0, step=None
):
    """(host-only seconds, auto seconds) of one layer for a call of `tokens` tokens, as the cost model predicts.
    With the model's `step` (a StepShape): of a whole step (the device's own work too), host-only layers in the
    micro-batch pipeline where it pays (planning/pipeline_model.py: beside an accelerator, attention hides behind
    the host's experts), auto's layers without it (they overlap their device and host shares within each call)."""
    counts = expected_routing(tokens, shape, zipf)
    host = layer_time(profile, counts, ["host"] * shape.experts).seconds
    auto = auto_layer_seconds(profile, counts, cached, can_stream)
    if step is None:
        return host, auto
    rows, seq = rows_and_length(tokens)
    return best_micro_batches(profile, step, rows, seq, zipf=zipf).seconds, serial_step(profile, step, rows, seq, auto)


@dataclass(frozen=True)
class AutoChoice:
    use_device: bool
    reason: str
    host_s: dict  # phase tokens -> predicted seconds of one layer, all experts on the host
    auto_s: dict  # the same with the device cache and streams

    def summary(self) -> str:
        return ("device cache and host" if self.use_device else "host only") + f": {self.reason}"


def choose_auto(
    profile: Profile | None,
    shape: Shape,
    cached: int,
    can_stream: bool,
    phases=PHASES,
    zipf: float = 0.0,
    step: StepShape | None = None,
) -> AutoChoice:
    """Whether auto with `cached` experts per layer in the device cache (and streams, if `can_stream`) is
    predicted to beat host-only layers by WORTH_IT in some phase (with `step`, whole steps: predicted_gain)."""
    if profile is None or not profile.device_helps:
        why = "no probe profile" if profile is None else "the device shares the host's cores and is not faster"
        return AutoChoice(False, why, {}, {})
    if cached <= 0 and not can_stream:
        return AutoChoice(False, "the device budget holds no expert", {}, {})
    host_s, auto_s = {}, {}
    for tokens in phases:
        host_s[tokens], auto_s[tokens] = predicted_gain(profile, shape, cached, can_stream, tokens, zipf, step)
    gains = {tokens: host_s[tokens] / max(auto_s[tokens], 1e-12) for tokens in phases}
    best = max(gains, key=gains.get)
    shown = ", ".join(f"{tokens} tokens {gain:.2f}x" for tokens, gain in gains.items())
    if gains[best] >= WORTH_IT:
        return AutoChoice(True, f"predicted gain over host {shown}", host_s, auto_s)
    return AutoChoice(False, f"predicted gain over host {shown}, below {WORTH_IT:.2f}x", host_s, auto_s)
