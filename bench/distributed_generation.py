"""bench/distributed.py's generation half: decode over expert shards measured on this machine (1 process x 2
threads against 2 processes x 1 thread, each holding half of every layer's experts, `moe_jax.generation.lockstep`),
and a model of N hosts serving DeepSeek-V3 (61 layers, 58 of them MoE: 256 experts top-8, hidden 7168, int4
experts) at 10 and 100 Gb/s with routed dispatch (a process sends only its experts' tokens' rows) and with every
row sent.

Decode is timed with sampled tokens (temperature 1: routing varies from step to step, as a real model's does; a
random-weight model's greedy tokens cycle among a few and keep the same experts hot) as the difference of two
generations 8 and 40 tokens long from the same prompts (prefill and the first steps cancel out; medians of 3 of
each); the bytes each process sent per decode step come from the native sum's counters over the same difference.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import ONE_THREAD_XLA  # noqa: E402

SHORT, LONG = 8, 40  # the two generations' lengths: their difference is LONG - SHORT decode steps
REPEATS = 3  # of each, alternating: medians
BATCHES = (1, 8)

# DeepSeek-V3 / R1 (config.json of deepseek-ai/DeepSeek-V3): 61 layers, the first 3 dense; the routed experts are
# 653.5B of its 671B parameters
DEEPSEEK_V3 = dict(moe_layers=58, experts=256, top_k=8, hidden=7168, expert_ffn=2048, dense_params=17.5e9)
Q4_0_BYTES_PER_PARAM = 18 / 32  # a scale (2 bytes) per 32 4-bit weights
DENSE_BYTES_PER_PARAM = 2  # bfloat16 attention, shared experts, head
ACTIVATION_BYTES = 2  # bfloat16 rows on the wire
HOSTS = (1, 2, 4, 8, 16)


def worker(model_dir: str, out: str, threads: int):
    """One process of a generation run; process 0 writes {batch: (decode tokens/s, bytes sent per step, bytes every
    row would take per step)}."""
    import moe_jax
    from moe_jax import distributed, process_links
    from moe_jax.distributed import this_process_shard
    from moe_jax.generation import lockstep

    world = distributed.join()
    model = moe_jax.load_model(model_dir, expert_shard=this_process_shard(world.count), host_threads=threads)
    rng = np.random.default_rng(0)

    def measure():
        figures = {}
        for batch in BATCHES:
            prompts = [[int(t) for t in rng.integers(3, model.config.vocab_size, 16)] for _ in range(batch)]
            for length in (SHORT, LONG):  # compiles each one's shapes (their KV caches differ in length)
                model.generate(prompts, max_new_tokens=length, temperature=1.0)
            runs = {SHORT: [], LONG: []}
            for repeat in range(REPEATS):
                for length in (SHORT, LONG):
                    sent_before = process_links.bytes_sent()
                    start = time.perf_counter()
                    model.generate(prompts, max_new_tokens=length, temperature=1.0, seed=repeat)
                    seconds = time.perf_counter() - start
                    runs[length].append((seconds, *np.subtract(process_links.bytes_sent(), sent_before)))
            steps = LONG - SHORT
            short, long = (np.median(np.array(runs[n], np.float64), axis=0) for n in (SHORT, LONG))
            seconds, sent, every_row = long - short
            figures[batch] = (batch * steps / seconds, sent / steps, every_row / steps)
        return figures

    figures = lockstep.run(model, measure)
    if world.is_main:
        Path(out).write_text(json.dumps(figures))


def sum_worker(out: str):
    """One process of the sum's latency: 48 chained sums over processes in a jitted step (a decode step's MoE layers
    one after another), one row of 512 and of 7168 values; process 0 writes {width: microseconds a sum}."""
    import jax
    import jax.numpy as jnp

    from moe_jax import distributed, process_links
    from moe_jax.native import process_sum

    world = distributed.join()
    links = process_links.connect(world)
    process_sum.use_links(links)
    figures = {}
    for width in (512, 7168):
        row, touched = jnp.ones((1, width), jnp.float32), jnp.ones((1,), jnp.int32)

        @jax.jit
        def chained(x, touched=touched):
            for _ in range(48):
                x = process_sum.process_sum(x * 0.5, touched)
            return x

        chained(row).block_until_ready()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            chained(row).block_until_ready()
            times.append(time.perf_counter() - start)
        figures[width] = float(np.median(times)) / 48 * 1e6
    process_sum.use_links(None)
    links.close()
    if world.is_main:
        Path(out).write_text(json.dumps(figures))


def sum_latency() -> list[dict]:
    """Microseconds a sum over 2 processes takes on this machine (TCP over loopback, each process on its core)."""
    figures = _run(None, 2, mode="sums")
    return [{"row_values": int(width), "us_per_sum": us} for width, us in figures.items()]


def measured(model_dir: Path, rounds: int) -> list[dict]:
    """1 process x 2 threads and 2 processes x 1 thread (expert shards), interleaved `rounds` times: medians."""
    runs: dict[str, list[dict]] = {"1 x 2 threads": [], "2 x 1 thread, expert shards": []}
    for _ in range(rounds):
        for label, processes in (("1 x 2 threads", 1), ("2 x 1 thread, expert shards", 2)):
            runs[label].append(_run(model_dir, processes))
    rows = []
    for label, results in runs.items():
        for batch in BATCHES:
            key = str(batch)
            rate = float(np.median([r[key][0] for r in results]))
            rows.append(
                {
                    "run": label,
                    "batch": batch,
                    "decode_tokens_per_s": rate,
                    "vs_one_process": rate / float(np.median([r[key][0] for r in runs["1 x 2 threads"]])),
                    "routed_bytes_per_step": float(np.median([r[key][1] for r in results])),
                    "every_row_bytes_per_step": float(np.median([r[key][2] for r in results])),
                }
            )
    return rows


def _run(model_dir: Path | None, processes: int, mode: str = "generate") -> dict:
    threads = 2 if processes == 1 else 1
    with tempfile.TemporaryDirectory(prefix="moe_jax_bench_generation_") as scratch:
        out = Path(scratch) / "figures.json"
        command = [str(Path(__file__).resolve()), mode, str(out), str(model_dir), str(threads)]
        env = None
        if threads == 1:
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD_XLA}".strip()}
        launcher = [sys.executable, "-m", "moe_jax.launch", "-n", str(processes)] if processes > 1 else [sys.executable]
        done = subprocess.run([*launcher, *command], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"generation x {processes} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def touched_share(hosts: int, experts: int, top_k: int) -> float:
    """The share of tokens with at least one of their top-k experts (uniform routing) on a given host."""
    others = experts - experts // hosts
    return 1.0 - math.comb(others, top_k) / math.comb(experts, top_k)


def hosts_model(gbps: float, ram_gbps: float, latency_us: float, host_ram_gb: float) -> list[dict]:
    """Decode tokens/s of DeepSeek-V3 (int4 experts) over N hosts, each reading its share of the step's experts and
    all dense weights at `ram_gbps`, then per MoE layer one exchange: `latency_us` plus the bytes it sends at
    `gbps`, not overlapped with compute (the layers wait for their sums)."""
    s = DEEPSEEK_V3
    expert_bytes = 3 * s["hidden"] * s["expert_ffn"] * Q4_0_BYTES_PER_PARAM
    all_experts = s["moe_layers"] * s["experts"] * expert_bytes
    dense_bytes = s["dense_params"] * DENSE_BYTES_PER_PARAM
    link = gbps * 1e9 / 8
    rows = []
    for hosts in HOSTS:
        row = {"hosts": hosts, "link_Gbps": gbps, "GB_per_host": (all_experts / hosts + dense_bytes) / 1e9}
        row["fits_ram"] = row["GB_per_host"] <= 0.9 * host_ram_gb
        for batch in (1, 16):
            distinct = s["experts"] * (1 - (1 - s["top_k"] / s["experts"]) ** batch)  # experts a layer's step reads
            compute = (dense_bytes + s["moe_layers"] * distinct / hosts * expert_bytes) / (ram_gbps * 1e9)
            for name, share in (("routed", touched_share(hosts, s["experts"], s["top_k"])), ("every_row", 1.0)):
                row_bytes = s["hidden"] * ACTIVATION_BYTES + (4 if name == "routed" else 0)
                sent = (hosts - 1) * batch * share * row_bytes  # one layer's exchange, from each host
                exchange = (latency_us * 1e-6 + sent / link) if hosts > 1 else 0.0
                row[f"b{batch}_{name}_tok_s"] = batch / (compute + s["moe_layers"] * exchange)
        rows.append(row)
    return rows


def hosts_needed(host_ram_gb: float) -> int:
    """The fewest hosts (a divisor of 256) whose RAM holds DeepSeek-V3's int4 experts' share and a dense copy."""
    for row in hosts_model(10, 1, 0, host_ram_gb):
        if row["fits_ram"]:
            return row["hosts"]
    return 0


if __name__ == "__main__":
    mode, out, model_dir, threads = sys.argv[1:5]
    sum_worker(out) if mode == "sums" else worker(model_dir, out, int(threads))
