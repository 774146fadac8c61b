"""`python -m moe_jax.advise --model DIR [--batch N ...]`: co-compute or offload, answered with this machine's numbers.

How it works and why: docs/INTERNALS.md, moe_jax/planning/advise.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from host_kernels import HostKernelError
from moe_jax.api import DTYPES, resolve_profile, stored_quant
from moe_jax.cli import prog
from moe_jax.errors import InputError
from moe_jax.formats.checkpoint import open_checkpoint
from moe_jax.planning.auto_choice import WORTH_IT, auto_layer_seconds, choose_auto
from moe_jax.planning.cost_model import Profile, layer_time
from moe_jax.planning.memory_check import available_bytes, human_size, load_bytes, quantized_experts_bytes
from moe_jax.planning.model_shape import Shape, StepShape, expected_routing, step_shape
from moe_jax.planning.pipeline_model import best_micro_batches, rows_and_length, serial_step, step_timeline
from moe_jax.planning.plan import host_store_dtype, make_plan

OPTIONS = ("device", "offload", "host", "auto")


def auto_cached(shape: Shape, device_memory: float | None) -> int:
    """Experts per layer auto's cache holds beside its stream buffers in `device_memory` (None: unlimited)."""
    stream_buffers = 2 * shape.top_k * shape.expert_bytes
    room = shape.layers * shape.experts * shape.expert_bytes
    if device_memory is not None:
        room = max(0.0, device_memory - stream_buffers)
    return int(min(shape.experts, room // (shape.expert_bytes * shape.layers)))


def predict(
    profile: Profile,
    shape: Shape,
    tokens: int,
    zipf: float,
    device_memory: float | None,
    choice=None,
    step: StepShape | None = None,
) -> dict:
    """Seconds per step, tokens/s and device expert bytes of each option at one batch size: of the MoE layers'
    experts only, or with the model's `step`, of whole steps (the device's own work too; the host backend in the
    device/host pipeline where it pays, planning/pipeline_model.py). `choice`: auto's decision (choose_auto) for
    the phases that will run; default: this batch size alone."""
    counts = expected_routing(tokens, shape, zipf)
    e = shape.experts
    stream_buffers = 2 * shape.top_k * shape.expert_bytes
    memory = {"device": shape.layers * e * shape.expert_bytes, "offload": stream_buffers, "host": 0}
    layer = {
        "device": layer_time(profile, counts, ["resident"] * e).seconds,
        "offload": layer_time(profile, counts, ["stream"] * e).seconds,
        "host": layer_time(profile, counts, ["host"] * e).seconds,
    }
    # auto: what fits of the hottest experts stays cached, the planner places every expert per step; where the
    # shared rule finds no gain worth the device, auto is the host alone
    cached = auto_cached(shape, device_memory)
    choice = choice or choose_auto(profile, shape, cached, True, (tokens,), zipf, step)
    if choice.use_device:
        layer["auto"] = auto_layer_seconds(profile, counts, cached, True)
        memory["auto"] = stream_buffers + cached * shape.layers * shape.expert_bytes
    else:
        layer["auto"], memory["auto"] = layer["host"], 0
    seconds = {name: shape.layers * layer[name] for name in OPTIONS}
    if step is not None:  # the same formulas as auto's choice (auto_choice.predicted_gain)
        rows, seq = rows_and_length(tokens)
        seconds["host"] = best_micro_batches(profile, step, rows, seq, zipf=zipf).seconds
        for name in ("device", "offload"):
            seconds[name] = serial_step(profile, step, rows, seq, layer[name], host_lane=False)
        auto = serial_step(profile, step, rows, seq, layer["auto"])
        seconds["auto"] = auto if choice.use_device else seconds["host"]
    out = {}
    for name in OPTIONS:
        fits = device_memory is None or memory[name] <= device_memory
        out[name] = {
            "step_s": seconds[name],
            "tokens_per_s": tokens / seconds[name],
            "device_bytes": memory[name],
            "fits": fits,
        }
    return out


def transfer_question(profile: Profile, shape: Shape, tokens: int) -> dict:
    """Question 1 at this batch: one expert's device compute, host compute and weight copy, in seconds."""
    rows = tokens * shape.top_k / shape.experts
    copy = shape.expert_bytes / (profile.bus_gbps * 1e9)
    device, host = profile.device_time(rows), profile.host_time(rows)
    return {"rows_per_expert": rows, "device_s": device, "host_s": host, "copy_s": copy}


def co_compute_or_offload(prediction: dict) -> str:
    return "host" if prediction["host"]["step_s"] <= prediction["offload"]["step_s"] else "offload"


def recommend(prediction: dict) -> str:
    """The fastest option that fits in device memory; auto only when clearly ahead of the single paradigms."""
    fitting = {name: p["step_s"] for name, p in prediction.items() if p["fits"]}
    single = min((n for n in fitting if n != "auto"), key=fitting.get)
    if "auto" in fitting and fitting["auto"] * WORTH_IT < fitting[single]:
        return "auto"
    return single


def cpu_question(profile: Profile, shape: Shape) -> dict:
    """Question 2: the CPU's instruction set extensions, its host expert rates and a memory copy's bandwidth."""
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    units = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve") if f in flags]
    src = np.ones(32 << 20, np.float64)  # 256 MiB
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    memcpy_gbps = 2 * src.nbytes / best / 1e9  # read + write
    decode_gbps = profile.expert_bytes / profile.host_time(1.0) / 1e9
    big = float(profile.host_rows[-1])
    gflops = 2 * big * shape.expert_params / profile.host_time(big) / 1e9
    vector = any(u in units for u in ("avx2", "avx512f", "asimd", "sve"))
    return {
        "units": units,
        "memcpy_gbps": memcpy_gbps,
        "host_decode_weight_gbps": decode_gbps,
        "host_prefill_gflops": gflops,
        "enough": vector and decode_gbps >= 0.25 * memcpy_gbps,
    }


def host_memory_question(checkpoint, dtype: str, available: int | None) -> dict:
    """Question 4: the host RAM a load needs with the host backend (dense weights, experts, the kernels' packed
    copies: what load_model counts before it allocates) in `dtype` and the other dtype, each with float, int8 and
    int4 experts (and first the format the checkpoint ships its experts in, which a load keeps by default: GPT-OSS's
    MXFP4), against what this machine has; the first that fits, the asked dtype and the default experts first."""
    dtypes = [dtype, *(d for d in ("bfloat16", "float32") if d != dtype)]
    options = []
    for d in dtypes:
        for quant in dict.fromkeys((checkpoint.shipped_quant(), None, "int8", "int4")):
            try:
                plan = make_plan(d, host_store_dtype(checkpoint, d), quant=stored_quant(checkpoint, quant))
            except (InputError, HostKernelError) as e:  # a format this CPU or this store cannot take
                options.append({"dtype": d, "quant": quant, "bytes": None, "fits": False, "why_not": str(e)})
                continue
            need = sum(load_bytes(checkpoint, np.dtype(DTYPES[d]).itemsize, plan.host_kernels).values())
            options.append({"dtype": d, "quant": quant, "bytes": need, "fits": available is None or need <= available})
    fitting = next((o for o in options if o["fits"]), None)
    return {"available": available, "options": options, "fits_as_asked": options[0]["fits"], "first_fitting": fitting}


HOST_RAM_USABLE = 0.9  # of a host's RAM for the weights: the rest for the KV cache, the OS and the libraries


def hosts_question(checkpoint, dtype: str, host_ram_bytes: int) -> list[dict]:
    """Question 6: for float, int8 and int4 experts, the fewest processes of an expert-parallel run
    (--expert-shards N, a divisor of the experts per layer), each on a host of `host_ram_bytes`, whose share (a
    copy of the dense weights, 1/N of the experts, held or mapped) fits HOST_RAM_USABLE of it."""
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    c = checkpoint.config
    dense = load_bytes(checkpoint, itemsize, None)["dense weights"]
    params = 3 * c.hidden_size * c.expert_intermediate_size * c.num_experts * len(c.moe_layers)
    rows = []
    for quant in (None, "int8", "int4"):
        experts = quantized_experts_bytes(checkpoint, quant) if quant else params * itemsize
        divisors = [n for n in range(1, c.num_experts + 1) if c.num_experts % n == 0]
        hosts = next((n for n in divisors if dense + experts / n <= HOST_RAM_USABLE * host_ram_bytes), None)
        per_host = dense + experts / hosts if hosts else None
        rows.append(
            {"dtype": dtype, "quant": quant, "hosts": hosts, "bytes_per_host": per_host, "dense_bytes": dense,
             "most_hosts": divisors[-1]}
        )  # fmt: skip
    return rows


def pipeline_question(profile: Profile, step: StepShape, tokens: int, zipf: float = 0.0) -> dict:
    """Question 5 at this batch: the host backend's whole step without and with the device/host micro-batch
    pipeline (planning/pipeline_model.py), the micro-batches it would take, each lane's busy share."""
    rows, seq = rows_and_length(tokens)
    plain = step_timeline(profile, step, rows, seq, 1, zipf=zipf)
    best = best_micro_batches(profile, step, rows, seq, zipf=zipf)
    return {
        "rows": rows,
        "tokens_per_row": seq,
        "plain_step_s": plain.seconds,
        "micro_batches": best.micro_batches,
        "pipelined_step_s": best.seconds,
        "device_busy": best.device_busy,
        "host_busy": best.host_busy,
    }


def advise(
    profile: Profile,
    shape: Shape,
    batches,
    zipf: float = 0.0,
    device_memory: float | None = None,
    step: StepShape | None = None,
) -> dict:
    """The answers at each batch size; auto decides once for all of them (the phases that will run), as
    backend="auto" does at load. With the model's `step`, also the pipeline's (question 5)."""
    choice = choose_auto(profile, shape, auto_cached(shape, device_memory), True, tuple(batches), zipf, step)
    rows = []
    for tokens in batches:
        prediction = predict(profile, shape, tokens, zipf, device_memory, choice, step)
        rows.append(
            {
                "tokens": tokens,
                "transfer": transfer_question(profile, shape, tokens),
                "options": prediction,
                "co_compute_or_offload": co_compute_or_offload(prediction),
                "recommend": recommend(prediction),
                **({"pipeline": pipeline_question(profile, step, tokens, zipf)} if step is not None else {}),
            }
        )
    return {"rows": rows, "auto": {"use_device": choice.use_device, "reason": choice.reason}}


def main(argv=None):
    parser = argparse.ArgumentParser(prog=prog("advise"), description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face or converted checkpoint directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 256, 4096], help="tokens per step")
    parser.add_argument("--profile", type=Path, help="probe profile (default: this machine's, measured once)")
    parser.add_argument("--bus-gbps", type=float, help="simulate a host->device bus of this bandwidth")
    parser.add_argument("--device-memory-mb", type=float, help="device memory for experts, MiB (default: unlimited)")
    parser.add_argument("--zipf", type=float, default=0.0, help="routing skew (0: uniform)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=list(DTYPES), help="the model's dtype to size (default: bfloat16)"
    )
    parser.add_argument(
        "--host-ram-gb", type=float, help="also: how many hosts of this RAM an expert-parallel run needs"
    )
    parser.add_argument("--json", type=Path, help="also write the answers here")
    args = parser.parse_args(argv)
    if args.host_ram_gb is not None and not args.host_ram_gb > 0:
        raise InputError(f"--host-ram-gb must be > 0, got {args.host_ram_gb}")
    if any(b < 1 for b in args.batch):
        raise InputError(f"--batch sizes must be >= 1, got {args.batch}")
    if args.bus_gbps is not None and args.bus_gbps <= 0:
        raise InputError(f"--bus-gbps must be > 0, got {args.bus_gbps}")

    checkpoint = open_checkpoint(args.model)
    config = checkpoint.config
    step = step_shape(config, np.dtype(DTYPES[args.dtype]).itemsize)
    shape = step.experts
    profile = fit_profile(resolve_profile(args.profile, config, np.float32), shape)
    if args.bus_gbps is not None:
        profile = profile.with_bus(args.bus_gbps)
    memory = None if args.device_memory_mb is None else args.device_memory_mb * 2**20
    answer = advise(profile, shape, args.batch, args.zipf, memory, step)
    answer["cpu"] = cpu_question(profile, shape)
    answer["host_memory"] = host_memory_question(checkpoint, args.dtype, available_bytes())
    if args.host_ram_gb is not None:
        answer["hosts"] = hosts_question(checkpoint, args.dtype, int(args.host_ram_gb * 2**30))
    _print(answer, profile, shape, memory)
    if args.host_ram_gb is not None:
        _print_hosts(answer["hosts"], args.host_ram_gb)
    if args.json:
        args.json.write_text(json.dumps(answer, indent=1, default=float))


def fit_profile(profile: Profile, shape: Shape) -> Profile:
    """The profile for this model's experts: copies of its bytes (in its dtype); compute times scaled by its
    size when the probe measured another shape (float32 experts of profile.expert_bytes)."""
    scale = shape.expert_params * 4 / profile.expert_bytes
    return dataclasses.replace(
        profile,
        expert_bytes=float(shape.expert_bytes),
        host_seconds=profile.host_seconds * scale,
        device_seconds=profile.device_seconds * scale,
        dense_seconds=None if profile.dense_seconds is None else profile.dense_seconds * scale,
    )


def _print(answer: dict, profile: Profile, shape: Shape, memory):
    cpu = answer["cpu"]
    print(
        f"model: {shape.layers} MoE layers x {shape.experts} experts (top-{shape.top_k}), "
        f"{shape.expert_bytes / 2**20:.1f} MiB per expert; bus {profile.bus_gbps:.1f} GB/s"
        + (f"; device memory for experts {memory / 1e9:.1f} GB" if memory else "")
    )
    print("\n1. is one expert's compute well above its transfer time?")
    for row in answer["rows"]:
        t = row["transfer"]
        verdict = "yes: copies hide behind compute" if t["device_s"] >= t["copy_s"] else "no: the bus bounds offload"
        faster = " (the host computes it faster than the bus moves it)" if t["host_s"] < t["copy_s"] else ""
        print(
            f"   {row['tokens']:>6} tokens ({t['rows_per_expert']:.1f} rows/expert): "
            f"device {t['device_s'] * 1e3:.3f} ms, host {t['host_s'] * 1e3:.3f} ms, copy {t['copy_s'] * 1e3:.3f} ms "
            f"-> {verdict}{faster}"
        )
    print("\n2. can this CPU do the experts?")
    print(
        f"   units: {', '.join(cpu['units']) or 'none found'}; memory copy {cpu['memcpy_gbps']:.1f} GB/s; host experts "
        f"{cpu['host_decode_weight_gbps']:.1f} GB/s at 1 row, {cpu['host_prefill_gflops']:.0f} GFLOP/s at "
        f"{int(profile.host_rows[-1])} rows -> {'yes' if cpu['enough'] else 'weak'}"
    )
    whole = "pipeline" in answer["rows"][0]
    print(f"\n3. predicted {'whole-step' if whole else 'MoE-layer'} throughput (tokens/s) and device expert memory")
    print(f"   {'tokens':>6} " + " ".join(f"{o:>18}" for o in OPTIONS) + "   co-compute/offload   use")
    for row in answer["rows"]:
        cells = []
        for name in OPTIONS:
            p = row["options"][name]
            mark = "" if p["fits"] else "!"
            cells.append(f"{p['tokens_per_s']:>9,.0f} {p['device_bytes'] / 2**20:>6.0f}MiB{mark:1}")
        choice = {"host": "co-compute", "offload": "offload"}[row["co_compute_or_offload"]]
        print(f"   {row['tokens']:>6} " + " ".join(cells) + f"   {choice:>18}   {row['recommend']}")
    auto = answer["auto"]
    print(f"   auto: {'device cache and host' if auto['use_device'] else 'host only'} ({auto['reason']})")
    if any(not p["fits"] for row in answer["rows"] for p in row["options"].values()):
        print("   (! does not fit the device memory given)")
    _print_host_memory(answer["host_memory"])
    _print_pipeline(answer["rows"], profile)


def _print_host_memory(memory: dict):
    available = memory["available"]
    print(f"\n4. does it fit in host RAM (host backend; {_amount(available)} available)?")

    def name(o):
        return f"{o['dtype']}{' + ' + o['quant'] if o['quant'] else ''}"

    for o in memory["options"]:
        state = "fits" if o["fits"] else "does not fit" if o["bytes"] is not None else f"n/a ({o['why_not']})"
        print(f"   {name(o):>18}: {_amount(o['bytes']) if o['bytes'] is not None else '':>10} {state}")
    asked, first = memory["options"][0], memory["first_fitting"]
    if memory["fits_as_asked"]:
        print(f"   -> fits as asked ({name(asked)})")
    elif first is not None:
        flags = f"--dtype {first['dtype']}" + (f" --quant {first['quant']}" if first["quant"] else "")
        print(f"   -> does not fit as asked ({name(asked)}); it would with {name(first)} ({flags})")
    else:
        print("   -> does not fit this machine in any format (a machine with more memory, or fewer layers)")


def _print_hosts(rows: list[dict], host_ram_gb: float):
    print(f"\n6. how many hosts of {host_ram_gb:g} GiB (expert parallel: --expert-shards N, one process a host)?")
    for r in rows:
        name = f"{r['dtype']}{' + ' + r['quant'] if r['quant'] else ''}"
        if r["hosts"] is None:
            too_big = r["dense_bytes"] > HOST_RAM_USABLE * host_ram_gb * 2**30
            why = "its dense weights alone do not fit a host" if too_big else f"does not fit {r['most_hosts']} hosts"
            print(f"   {name:>18}: {why} (each holds a copy of the dense weights)")
        else:
            print(f"   {name:>18}: {r['hosts']} host(s), {_amount(int(r['bytes_per_host']))} each")


def _print_pipeline(rows: list[dict], profile: Profile):
    if "pipeline" not in rows[0]:
        return
    print("\n5. does the device/host micro-batch pipeline pay (host backend, whole steps)?")
    if not profile.parallel_lanes:
        print("   no: jax's device is this CPU, whose cores the host lane uses too (the plan keeps it off)")
    for row in rows:
        p = row["pipeline"]
        print(
            f"   {row['tokens']:>6} tokens ({p['rows']} x {p['tokens_per_row']}): "
            f"plain {p['plain_step_s'] * 1e3:.2f} ms, "
            f"{p['micro_batches']} micro-batch(es) {p['pipelined_step_s'] * 1e3:.2f} ms; "
            f"device busy {p['device_busy']:.0%}, host busy {p['host_busy']:.0%}"
        )


def _amount(n: int | None) -> str:
    return "unknown" if n is None else human_size(n)
