"""Scale-out on this machine: 1 process x 2 threads against 2 processes x 1 thread, data parallel and expert
parallel, and a model of N hosts.

    python bench/distributed.py [--shape bench] [--batch 4 --seq 256] [--steps 4] [--bandwidth-gbps 10]
        [--generation-rounds 3] [--ram-gbps 200] [--latency-us 25] [--host-ram-gb 256]

Each run is LoRA training's forward and backward (r=8 on the attention projections) over the same random global
batch: one process with 2 host threads (XLA's own pool as it comes), then 2 processes (`python -m moe_jax.launch`)
each with 1 host thread and XLA on one thread, each with its half of the batch's rows: data parallel (every
process holds all experts; the LoRA gradients are averaged after the step) and expert parallel (each holds half
of every layer's experts; tokens travel to their experts inside the step). Two warm-up steps, then the median of
`--steps`. Bytes sent per step and process are counted from the collectives' shapes (gradients gathered; for
expert parallel, per MoE layer and direction, the activations gathered and the outputs reduce-scattered).

The model of N hosts, each like this machine and each with the one-process run's rows (a global batch N times
larger): a step is the one-process step's compute (for expert parallel: all N hosts' tokens through 1/N of the
experts, the same work) plus the bytes each host sends over the interconnect at --bandwidth-gbps, not overlapped
(the collectives wait for each other here).

Then generation over expert shards, measured here and modelled for DeepSeek-V3 over N hosts
(bench/distributed_generation.py). Writes bench/results/distributed.json and bench/reports/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import distributed_generation as generation  # noqa: E402
from bench.common import ONE_THREAD_XLA, markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402

WARMUP = 2
HOSTS = (1, 2, 4, 8, 16)


def worker(args):
    """One process of a run: times its steps, and process 0 writes the figures to args.out."""
    import jax

    import moe_jax
    from moe_jax import distributed
    from moe_jax.distributed import this_process_shard
    from moe_jax.model.lora import LoRAConfig
    from moe_jax.train.objective import lora_value_and_grad

    world = distributed.join()
    expert_parallel = args.worker == "expert"
    shard = this_process_shard(world.count) if expert_parallel else None
    model = moe_jax.load_model(args.model, expert_shard=shard, host_threads=args.threads)
    model.attach_lora(LoRAConfig(rank=8, alpha=16.0))
    value_and_grad, lora_state = lora_value_and_grad(model)
    config = model.config
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    mask = np.ones_like(tokens)
    rows = world.rows(args.batch)
    times = []
    for step in range(WARMUP + args.steps):
        start = time.perf_counter()
        loss, grads = model.run_jitted(value_and_grad, lora_state, tokens[rows], mask[rows])
        if world.several and not expert_parallel:
            loss, grads = distributed.weighted_mean((loss, grads), int(mask[rows][:, 1:].sum()))
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    gradient_bytes = 4 * sum(int(np.size(g)) for g in jax.tree.leaves(grads))
    sent = bytes_sent(world.count, expert_parallel, gradient_bytes, args.batch * args.seq, config)
    if world.is_main:
        Path(args.out).write_text(
            json.dumps({"step_s": statistics.median(times), "bytes_sent": sent, "gradient_bytes": gradient_bytes})
        )


def bytes_sent(processes: int, expert_parallel: bool, gradient_bytes: int, tokens: int, config) -> int:
    """What one process sends in a step, from the collectives' shapes. Data parallel: its gradients to every
    other process (an all-gather, + the weight). Expert parallel: per MoE layer, forward and backward, its share
    of the activations to every other process (hidden x 4 bytes a token, + top-k ids and weights on the way in)
    and its partial outputs' other shares (a reduce-scatter), then the gradients' sum (all-reduce, ring)."""
    others = processes - 1
    if processes == 1:
        return 0
    if not expert_parallel:
        return others * (gradient_bytes + 4)
    mine = tokens // processes
    activations = mine * config.hidden_size * 4
    routing = mine * config.num_experts_per_tok * 8
    per_layer = 2 * others * (2 * activations + routing)  # (gather in + scatter out) x (forward + backward)
    return len(config.moe_layers) * per_layer + 2 * others * gradient_bytes // processes


def run(mode: str, processes: int, threads: int, args, model_dir: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="moe_jax_bench_distributed_") as scratch:
        out = Path(scratch) / f"{mode}.json"
        flags = {"worker": mode, "model": model_dir, "out": out, "threads": threads}
        flags.update(batch=args.batch, seq=args.seq, steps=args.steps)
        command = [str(Path(__file__).resolve()), *(f"--{name}={value}" for name, value in flags.items())]
        env = dict(os.environ)
        if threads == 1:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {ONE_THREAD_XLA}".strip()
        launcher = [sys.executable, "-m", "moe_jax.launch", "-n", str(processes)] if processes > 1 else [sys.executable]
        done = subprocess.run([*launcher, *command], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} x {processes} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        figures = json.loads(out.read_text())
    return {
        "run": f"{processes} process(es) x {threads} thread(s)",
        "parallel": mode if processes > 1 else "-",
        "tokens_per_s": args.batch * args.seq / figures["step_s"],
        "step_ms": 1e3 * figures["step_s"],
        "bytes_sent_per_step": figures["bytes_sent"],
        "_gradient_bytes": figures["gradient_bytes"],
    }


def scaling(single: dict, config, args, gradient_bytes: int) -> list[dict]:
    """Predicted tokens/s of N hosts like this one (each the one-process run's speed) at --bandwidth-gbps."""
    step_s = single["step_ms"] / 1e3
    bandwidth = args.bandwidth_gbps * 1e9 / 8
    rows = []
    for hosts in HOSTS:
        row = {"hosts": hosts}
        for mode in ("data", "expert"):
            sent = bytes_sent(hosts, mode == "expert", gradient_bytes, args.batch * args.seq * hosts, config)
            seconds = step_s + sent / bandwidth  # each host: the same rows as the one-host run (a batch N x larger)
            row[f"{mode}_tokens_per_s"] = hosts * args.batch * args.seq / seconds
            row[f"{mode}_efficiency"] = step_s / seconds
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(parser)
    parser.add_argument("--batch", type=int, default=4, help="global batch rows (even)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps after 2 warm-up steps")
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0, help="interconnect for the N-host model")
    parser.add_argument("--generation-rounds", type=int, default=3, help="interleaved rounds of the generation runs")
    parser.add_argument("--ram-gbps", type=float, default=200.0, help="a host's RAM GB/s, for the DeepSeek-V3 model")
    parser.add_argument("--latency-us", type=float, default=25.0, help="one exchange's latency, for the same model")
    parser.add_argument("--host-ram-gb", type=float, default=256.0, help="a host's RAM, for the same model")
    parser.add_argument("--worker", choices=("data", "expert", "single"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.batch % 2:
        parser.error("--batch must be even (split over 2 processes)")
    use_shape(args.shape)
    model_dir = bench_model_dir()
    from moe_jax.formats.checkpoint import read_config

    config = read_config(model_dir)
    rows = [
        run("single", 1, 2, args, model_dir),
        run("data", 2, 1, args, model_dir),
        run("expert", 2, 1, args, model_dir),
    ]
    gradient_bytes = rows[0]["_gradient_bytes"]
    for row in rows:
        del row["_gradient_bytes"]
        row["vs_one_process"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    title = f"{args.shape} model, LoRA forward+backward, batch {args.batch} x {args.seq}, this machine"
    print_table(title, rows)
    model = scaling(rows[0], config, args, gradient_bytes)
    model_title = (
        f"model: N hosts like this one, each {args.batch} x {args.seq} rows a step, {args.bandwidth_gbps:g} Gb/s"
    )
    print_table(model_title, model)
    decode = generation.measured(model_dir, args.generation_rounds)
    decode_title = (
        f"{args.shape} model, sampled decode (temperature 1) over expert shards, this machine, "
        f"medians of {args.generation_rounds} interleaved rounds"
    )
    print_table(decode_title, decode)
    sums = generation.sum_latency()
    sums_title = "one sum over 2 processes on this machine (48 chained in a jitted step, loopback TCP), median of 20"
    print_table(sums_title, sums)
    deepseek = [
        row
        for gbps in (10, 100)
        for row in generation.hosts_model(gbps, args.ram_gbps, args.latency_us, args.host_ram_gb)
    ]
    needed = generation.hosts_needed(args.host_ram_gb)
    deepseek_title = (
        f"model: DeepSeek-V3 decode over N hosts (int4 experts, bfloat16 dense copy on each), {args.ram_gbps:g} GB/s "
        f"RAM, {args.latency_us:g} us an exchange; {needed} hosts of {args.host_ram_gb:g} GB hold it"
    )
    print_table(deepseek_title, deepseek)
    write_json(
        "distributed",
        {"shape": args.shape, "runs": rows, "hosts_model": model, "decode": decode, "sums": sums,
         "deepseek_v3": deepseek, "args": vars(args)},
    )  # fmt: skip
    write_report(
        "distributed",
        [
            *report_header("Scale-out: training and generation over processes"),
            f"## {title}", "", *markdown_table(rows), "",
            f"## {model_title}", "", *markdown_table(model), "",
            f"## {decode_title}", "",
            "Bytes per step: what each process sent for its MoE layers' sums over processes in one decode step; "
            "routed sends only the rows of its experts' tokens, every_row what sending all rows would have taken.",
            "", *markdown_table(decode), "",
            f"## {sums_title}", "", *markdown_table(sums), "",
            f"## {deepseek_title}", "", *markdown_table(deepseek), "",
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
