"""The device/host micro-batch pipeline: measured here, and modelled for an accelerator.

    python bench/pipeline.py [--shape bench] [--rounds 5] [--micro-batches 2] [--split-cores] [--no-measure]

Measured (this machine, jax's device = this CPU): the host backend with the pipeline on (`--micro-batches`)
against off, A B A B in one process, on a LoRA training step (r=8 on attention, batch 4 x 256), a prefill
forward (4 x 256) and a batch of 16 generations (32-token prompts, 32 new tokens); the ratio per round and its
median; the outputs compared; one pipelined training step's lanes recorded (`LaneTimeline`): busy seconds per
lane, the time both were busy, and a Chrome trace (bench/results/pipeline_trace.json; open in Perfetto). The
cost model's prediction for this machine (its own probe, lanes sharing the cores) beside the measurement.
`--split-cores` makes this CPU two lanes, as a device beside a host: XLA's ops on one thread
(--xla_cpu_multi_thread_eigen=false), the host engine on one worker, so attention and experts can run at once on
the two cores; the prediction then comes from a probe measured the same way, its lanes taken as parallel.

Modelled (`planning/pipeline_model.py`, no accelerator needed): a whole Qwen3-30B-A3B (48 layers, bf16 experts
on the host) beside an H200, from this machine's probe of the model's expert shape (host lane) and the H200's
published rates (device lane, bus; `H200` below), for a training step (4 x 512), a prefill (1 x 2048) and decode
at batch 1 and 16: host without and with the pipeline, offload, auto with <= 10 GB of experts on the device, and
the device backend (every expert in HBM: 58 GB fits the H200's 141 GB). Writes bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import ONE_THREAD_XLA, RESULTS, print_table, write_json  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402
from moe_jax.planning import probe  # noqa: E402
from moe_jax.planning.advise import auto_cached, fit_profile  # noqa: E402
from moe_jax.planning.cost_model import Profile, layer_time, plan_layer  # noqa: E402
from moe_jax.planning.model_shape import Shape, StepShape, model_shape, step_shape  # noqa: E402
from moe_jax.planning.pipeline_model import best_micro_batches, serial_step, step_timeline  # noqa: E402
from moe_jax.planning.probe import cached_profile  # noqa: E402
from moe_jax.planning.simulate import zipf_routing  # noqa: E402

# published figures: H200 SXM dense bf16 989 TFLOP/s (half of it reached on these small GEMMs), HBM3e 4.8 TB/s,
# PCIe 5.0 x16 64 GB/s each way; a kernel launch ~5 us, a few per expert layer; one host callback from a
# jitted step ~1 ms (what the one GPU run so far saw per layer, issue 22) and a lighter 0.1 ms for contrast
H200 = dict(flops=989e12 * 0.5, hbm_bps=4.8e12, bus_gbps=64.0, launch_s=5e-6, callback_s=(1e-3, 1e-4))
DEVICE_MEMORY_FOR_EXPERTS = 10e9
ROUTING_DRAWS = 8
# the host lane: this machine's probe as measured, and as if 8x faster (the H200 machine's 16 cores against these
# 2, compute and memory bandwidth taken to scale with the cores: an assumption, not a measurement)
HOSTS = ((1.0, "this machine's probe"), (8.0, "this probe x 8 (16 cores)"))
QWEN3_30B_A3B = dict(layers=48, hidden=2048, ffn=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128)
# (name, rows, tokens per row, training)
PHASES = (
    ("training 4x512", 4, 512, True),
    ("prefill 1x2048", 1, 2048, False),
    ("decode b1", 1, 1, False),
    ("decode b16", 16, 1, False),
)


def measure(shape: str, rounds: int, micro_batches: int, host_threads: int | None) -> dict:
    import jax
    import jax.numpy as jnp

    import moe_jax
    from moe_jax.backends.lane_timeline import LaneTimeline
    from moe_jax.model.lora import LoRAConfig
    from moe_jax.train.objective import lora_value_and_grad

    use_shape(shape)
    path = bench_model_dir()
    dtype = "float32" if shape == "bench" else "bfloat16"
    models = {
        m: moe_jax.load_model(path, backend="host", dtype=dtype, pipeline=m, host_threads=host_threads)
        for m in (1, micro_batches)
    }
    rng = np.random.default_rng(0)
    vocab = models[1].config.vocab_size
    tokens = jnp.asarray(rng.integers(0, vocab, size=(4, 256)))
    mask = jnp.ones_like(tokens)
    prompts = [rng.integers(0, vocab, size=32).tolist() for _ in range(16)]
    steps = {}
    for m, model in models.items():
        model.attach_lora(LoRAConfig(rank=8, alpha=16, targets=("attention",)))
        value_and_grad, lora_state = lora_value_and_grad(model)
        steps[m] = {
            "training step": lambda f=value_and_grad, s=lora_state: jax.block_until_ready(f(s, tokens, mask)),
            "prefill 4x256": lambda model=model: model.logits(np.asarray(tokens)),
            "16 generations": lambda model=model: model.generate(prompts, max_new_tokens=32),
        }
    same = {
        "logits_max_abs_diff": float(
            np.abs(steps[1]["prefill 4x256"]() - steps[micro_batches]["prefill 4x256"]()).max()
        ),
        "generations_equal": steps[1]["16 generations"]() == steps[micro_batches]["16 generations"](),
    }
    rows = []
    for case in steps[1]:
        for m in models:
            steps[m][case]()  # compiled and warm
        seconds = {m: [] for m in models}
        for _ in range(rounds):
            for m in models:  # A B A B
                start = time.perf_counter()
                steps[m][case]()
                seconds[m].append(time.perf_counter() - start)
        ratios = [a / b for a, b in zip(seconds[1], seconds[micro_batches], strict=True)]
        rows.append(
            {
                "case": case,
                "plain_s": statistics.median(seconds[1]),
                f"pipelined_{micro_batches}_s": statistics.median(seconds[micro_batches]),
                "speedup": statistics.median(ratios),
                "speedup_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
            }
        )
    timeline = LaneTimeline()
    with timeline.recording(models[micro_batches].placement.runtime):
        steps[micro_batches]["training step"]()
    trace = timeline.chrome_trace(RESULTS / "pipeline_trace.json")
    config = models[1].config
    return {
        "rows": rows,
        "same_outputs": same,
        "timeline": timeline.summary(),
        "trace": str(trace),
        "plan": models[micro_batches].plan.lines(),
        "config": config,
    }


def predicted_here(config, micro_batches: int, split_cores: bool) -> dict:
    """The model's pipelined / plain ratio for this machine at the measured cases: its lanes on the same cores, or
    (`split_cores`) from a probe of one XLA thread and one host worker, the lanes taken as parallel."""
    d, f = config.hidden_size, config.expert_intermediate_size
    if split_cores:
        probed = dataclasses.replace(
            Profile.from_dict(probe.measure(d, f, probe.QUICK_ROWS, 5, 1)), parallel_lanes=True
        )
    else:
        probed = cached_profile(d, f)
    profile = fit_profile(probed, model_shape(config, 4))
    step = step_shape(config, 4)
    out = {}
    for case, rows, seq, training in (("training step", 4, 256, True), ("prefill 4x256", 4, 256, False)):
        plain = step_timeline(profile, step, rows, seq, 1, training).seconds
        piped = step_timeline(profile, step, rows, seq, micro_batches, training).seconds
        out[case] = plain / piped
    return out


def h200_profile(cpu: Profile, step: StepShape, callback_s: float, host_scale: float) -> Profile:
    """This machine's host lane (its times divided by `host_scale`) beside an H200's device lane and bus."""
    expert = step.experts
    rows = cpu.host_rows
    device = np.maximum(expert.expert_bytes / H200["hbm_bps"], 2 * rows * expert.expert_params / H200["flops"])
    return dataclasses.replace(
        cpu,
        bus_gbps=H200["bus_gbps"],
        bus_gbps_shared=H200["bus_gbps"] * cpu.bus_gbps_shared / cpu.bus_gbps,
        host_seconds=cpu.host_seconds / host_scale,
        host_call_s=cpu.host_call_s / host_scale,
        device_rows=rows,
        device_seconds=device + H200["launch_s"],
        dense_rows=rows,
        dense_seconds=device + H200["launch_s"],  # a plain product of the same weight: the same rates
        device_call_s=4 * H200["launch_s"],
        callback_s=callback_s,
        parallel_lanes=True,
    )


def qwen3_step() -> StepShape:
    q = QWEN3_30B_A3B
    d = q["hidden"]
    attention = 2 * d * q["heads"] * q["head_dim"] + 2 * d * q["kv_heads"] * q["head_dim"]
    experts = Shape(q["layers"], q["experts"], q["top_k"], 3 * d * q["ffn"], 2)  # bfloat16 experts
    return StepShape(experts, q["layers"], d, attention)


def drawn_layer_seconds(profile: Profile, expert: Shape, tokens: int, cached: int, place: str) -> float:
    """One MoE layer's experts over ROUTING_DRAWS uniform routings: all `place`d, or (place "auto") auto's
    planner with a fixed `cached` experts resident (under uniform routing no expert is hotter than another, so
    a decode step finds cached/experts of its experts there, not all of them as the expected routing would)."""
    rng = np.random.default_rng(0)
    seconds = []
    for _ in range(ROUTING_DRAWS):
        counts = zipf_routing(rng, tokens, expert.experts, expert.top_k, 0.0)
        if place == "auto":
            seconds.append(layer_time(profile, counts, plan_layer(profile, counts, set(range(cached)))).seconds)
        else:
            seconds.append(layer_time(profile, counts, [place] * expert.experts).seconds)
    return float(np.mean(seconds))


def simulated_h200(host_scale: float, callback_s: float) -> list[dict]:
    step = qwen3_step()
    expert = step.experts
    cpu = fit_profile(cached_profile(QWEN3_30B_A3B["hidden"], QWEN3_30B_A3B["ffn"]), expert)
    profile = h200_profile(cpu, step, callback_s, host_scale)
    cached = auto_cached(expert, DEVICE_MEMORY_FOR_EXPERTS)
    memory = {
        "offload": 2 * expert.top_k * expert.expert_bytes,
        "auto": 2 * expert.top_k * expert.expert_bytes + cached * expert.layers * expert.expert_bytes,
        "device": expert.layers * expert.experts * expert.expert_bytes,
    }
    out = []
    for name, rows, seq, training in PHASES:
        tokens = rows * seq
        plain = step_timeline(profile, step, rows, seq, 1, training)
        piped = best_micro_batches(profile, step, rows, seq, training)
        forced = step_timeline(profile, step, rows, seq, min(2, rows), training)
        steps = {
            "host": (plain.seconds, plain.device_busy, plain.host_busy),
            "host, 2 micro-batches": (forced.seconds, forced.device_busy, forced.host_busy),
            f"host, best ({piped.micro_batches})": (piped.seconds, piped.device_busy, piped.host_busy),
        }
        for option, place, host_lane in (
            ("offload", "stream", False),
            ("auto", "auto", True),
            ("device", "resident", False),
        ):
            layer = drawn_layer_seconds(profile, expert, tokens, cached, place)
            steps[option] = (serial_step(profile, step, rows, seq, layer, host_lane, training), None, None)
        for option, (seconds, device_busy, host_busy) in steps.items():
            out.append(
                {
                    "phase": name,
                    "option": option,
                    "step_ms": seconds * 1e3,
                    "tokens_per_s": tokens / seconds,
                    "device_expert_gb": memory.get(option, 0) / 1e9,
                    "device_busy": device_busy,
                    "host_busy": host_busy,
                }
            )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--no-measure", action="store_true", help="the model's tables only")
    parser.add_argument("--split-cores", action="store_true", help="XLA on one thread, the host engine on one worker")
    parser.add_argument(
        "--call-us",
        type=float,
        action="append",
        help="a host call's cost in microseconds, a modelled table each (default: pure_callback's 1000, and 100); "
        "bench/stream_calls.py measures the stream calls'",
    )
    args = parser.parse_args()
    if args.split_cores and ONE_THREAD_XLA not in os.environ.get("XLA_FLAGS", ""):  # before jax starts
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD_XLA}".strip()}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    out = {"split_cores": args.split_cores}
    if not args.no_measure:
        measured = measure(args.shape, args.rounds, args.micro_batches, 1 if args.split_cores else None)
        config = measured.pop("config")
        measured["predicted_speedup_here"] = predicted_here(config, args.micro_batches, args.split_cores)
        print_table(f"measured here, {args.shape} model: pipelined ({args.micro_batches}) vs plain", measured["rows"])
        print(f"outputs: {measured['same_outputs']}")
        print(f"timeline of one pipelined training step: {measured['timeline']}")
        print(f"the cost model's speedup for this machine: {measured['predicted_speedup_here']}")
        print("plan: " + "; ".join(line for line in measured["plan"] if "pipeline" in line))
        out["measured"] = measured
    out["h200_model"] = {}
    for host_scale, host in HOSTS:
        for callback_s in [us * 1e-6 for us in args.call_us] if args.call_us else H200["callback_s"]:
            table = simulated_h200(host_scale, callback_s)
            title = f"{host}, host call {callback_s * 1e6:g} us"
            print_table(f"modelled: Qwen3-30B-A3B beside an H200; host lane: {title}", table)
            out["h200_model"][title] = table
    out["h200_rates"] = H200
    write_json("pipeline", out)


if __name__ == "__main__":
    main()
