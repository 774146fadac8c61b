"""The whole step's timeline, device lane and host lane, with and without the micro-batch ping-pong
(backends/pipeline.py): what the advisor predicts, what auto weighs, what the plan's micro-batch count follows.

How it works and why: docs/INTERNALS.md, moe_jax/planning/pipeline_model.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_jax.model.transformer import micro_batch_bounds
from moe_jax.planning.cost_model import Profile, layer_time
from moe_jax.planning.model_shape import StepShape, expected_routing
from moe_jax.planning.plan import ExecutionPlan

MICRO_BATCHES = (1, 2, 4)
BACKWARD_FACTOR = 2.0
PIPELINE_WORTH_IT = 1.05  # more micro-batches only where predicted at least this much faster
PROMPT_LENGTH = 512  # a prefill or training step's tokens per row, where the advisor is given only tokens


@dataclass(frozen=True)
class StepTimeline:
    seconds: float
    device_busy_s: float
    host_busy_s: float
    micro_batches: int

    @property
    def device_busy(self) -> float:
        return self.device_busy_s / self.seconds if self.seconds else 0.0

    @property
    def host_busy(self) -> float:
        return self.host_busy_s / self.seconds if self.seconds else 0.0


def lane_seconds(profile: Profile, shape: StepShape, tokens: int, zipf: float = 0.0) -> tuple[float, float]:
    """(device, host) seconds of one layer's work for a micro-batch of `tokens` tokens: the device's own products
    and the activations' round trip over the bus; the host's experts (all of them on the host)."""
    counts = expected_routing(tokens, shape.experts, zipf)
    host = layer_time(profile, counts, ["host"] * shape.experts.experts).host_lane
    return device_seconds(profile, shape, tokens, to_host=True), float(host)


def device_seconds(profile: Profile, shape: StepShape, tokens: int, to_host: bool) -> float:
    """The device's own work in one layer for `tokens` tokens, and (`to_host`) the activations' round trip."""
    rows_alike = tokens * shape.device_params / shape.experts.expert_params  # the same FLOPs as this many rows
    seconds = profile.device_call_s + float(profile.dense_time(rows_alike))
    if to_host and profile.parallel_lanes:  # a device on the host's own CPU shares its memory: nothing crosses
        seconds += 2 * tokens * shape.hidden * shape.experts.itemsize / (profile.bus_gbps * 1e9)
    return seconds


def pass_timeline(profile: Profile, shape: StepShape, rows: int, seq: int, micro_batches: int, zipf=0.0, factor=1.0):
    """One pass (forward, or a backward at `factor` times its cost) over `rows` rows of `seq` tokens."""
    parts = [(b - a) * seq for a, b in micro_batch_bounds(rows, micro_batches)]
    lanes = [lane_seconds(profile, shape, tokens, zipf) for tokens in parts]
    device = [factor * d for d, _ in lanes]
    host = [factor * h for _, h in lanes]
    moe = shape.experts.layers
    # a plain pass makes one host call per MoE layer (its FFI call or callback); a pipelined one two per part
    calls = moe * (1 if len(parts) == 1 else 2 * len(parts)) * profile.callback_s
    device_busy = shape.layers * sum(device) + calls
    host_busy = moe * sum(host)
    if not profile.parallel_lanes:
        return StepTimeline(device_busy + host_busy, device_busy, host_busy, len(parts))
    submit = profile.callback_s  # a plain pass's one call per layer, a pipelined pass's start
    collect = profile.callback_s if len(parts) > 1 else 0.0  # a pipelined pass's finish
    dense = shape.layers - moe  # layers without experts: device work only, counted up front
    device_free = dense * sum(device)
    host_free = 0.0
    ready = [device_free] * len(parts)  # when each part's previous layer is back from the host
    for layer in range(moe):
        for m in range(len(parts)):
            start = max(device_free, ready[m]) + (collect if layer else 0.0)  # its previous layer finished
            device_free = start + device[m] + submit
            host_free = max(host_free, device_free) + host[m]
            ready[m] = host_free
    seconds = max(ready) + collect * len(parts)
    return StepTimeline(seconds, device_busy, host_busy, len(parts))


def step_timeline(profile, shape: StepShape, rows: int, seq: int, micro_batches: int, training=False, zipf=0.0):
    """A generation step's pass, or a training step's forward and backward."""
    forward = pass_timeline(profile, shape, rows, seq, micro_batches, zipf)
    if not training:
        return forward
    backward = pass_timeline(profile, shape, rows, seq, micro_batches, zipf, BACKWARD_FACTOR)
    return StepTimeline(
        forward.seconds + backward.seconds,
        forward.device_busy_s + backward.device_busy_s,
        forward.host_busy_s + backward.host_busy_s,
        forward.micro_batches,
    )


def serial_step(profile, shape: StepShape, rows: int, seq: int, expert_seconds: float, host_lane=True, training=False):
    """Seconds of a step whose MoE layers' experts take `expert_seconds` each, after the device's own work (no
    micro-batches): auto's layers (their own overlap is in `expert_seconds`), or without a host lane
    (`host_lane` False: no activations to the host, no callback) offload's or the device backend's."""
    device = device_seconds(profile, shape, rows * seq, to_host=host_lane)
    one_pass = shape.layers * device + shape.experts.layers * (expert_seconds + host_lane * profile.callback_s)
    return one_pass * (1 + BACKWARD_FACTOR) if training else one_pass


def best_micro_batches(profile, shape: StepShape, rows: int, seq: int, training=False, zipf=0.0) -> StepTimeline:
    """The timeline of the micro-batch count predicted fastest (more only where PIPELINE_WORTH_IT faster; never
    where the lanes share the cores, as the plan keeps it off there)."""
    best = step_timeline(profile, shape, rows, seq, 1, training, zipf)
    for m in MICRO_BATCHES[1:] if profile.parallel_lanes else ():
        if m > rows:
            break
        candidate = step_timeline(profile, shape, rows, seq, m, training, zipf)
        if candidate.seconds * PIPELINE_WORTH_IT < best.seconds:
            best = candidate
    return best


def rows_and_length(tokens: int) -> tuple[int, int]:
    """A step of `tokens` tokens as (rows, tokens per row): decode steps up to 256 tokens (one per row), else
    prompts of PROMPT_LENGTH."""
    if tokens <= 256:
        return tokens, 1
    return max(1, tokens // PROMPT_LENGTH), min(tokens, PROMPT_LENGTH)


def plan_with_profile(plan: ExecutionPlan, profile: Profile, shape: StepShape, tokens=2048, decode_rows=16):
    """The plan's default micro-batch counts (beside an accelerator) replaced by those the profile predicts
    fastest: for a prefill or training step of `tokens` tokens, and for a decode step of `decode_rows` rows."""
    rows, seq = rows_and_length(tokens)
    plain = step_timeline(profile, shape, rows, seq, 1)
    best = best_micro_batches(profile, shape, rows, seq)
    decode = best_micro_batches(profile, shape, decode_rows, 1)
    why = (
        f"the probe profile predicts {best.micro_batches} fastest for {tokens}-token steps "
        f"({plain.seconds * 1e3:.1f} ms plain, {best.seconds * 1e3:.1f} ms), {decode.micro_batches} for decode steps "
        f"of {decode_rows} rows"
    )
    reasons = tuple((part, text) for part, text in plan.why if part != "pipeline") + (("pipeline", why),)
    return dataclasses.replace(
        plan, micro_batches=best.micro_batches, decode_micro_batches=decode.micro_batches, why=reasons
    )
