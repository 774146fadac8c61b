"""The host expert hand-off's cost: the stream worker's protocol round trip, and per-layer call overhead inside a
jitted step for each way a step reaches the host experts.

    python bench/stream_calls.py [--layers 48] [--rounds 5] [--runs 2000]

(a) protocol: a device thread posts a go and waits for the done against the real worker (host_kernels
    StreamWorker) over a layer's fused forward with no tokens and with one token: the go -> done round trip that
    the CUDA handlers add to a layer, less the copies.
(b) in a jitted step: `--layers` chained calls of one tiny MoE layer (1 token) through XLA:CPU's direct FFI
    handler, the stream calls' submit/sync, and `jax.pure_callback`; the step's time divided by the layers, the
    three interleaved (A B C, C B A) over `--rounds`, medians.
On XLA:CPU the stream calls' device side is host code, so (b) measures their handlers and the worker, not a GPU's
stream: `bench/accelerator.sh` runs the CUDA side. Writes bench/results/stream_calls.json and
bench/reports/stream_calls.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import print_table, short_commit, write_json, write_report  # noqa: E402
from host_kernels import StreamWorker, cpu_features  # noqa: E402
from host_kernels.fused_forward import FusedForward, best_kernel, pack_layer  # noqa: E402
from host_kernels.layer_experts import LayerExperts  # noqa: E402
from host_kernels.store import ExpertStore  # noqa: E402
from moe_jax.doctor import cpu_model  # noqa: E402
from moe_jax.native import host_experts as native_experts  # noqa: E402
from moe_jax.native import stream_experts  # noqa: E402
from moe_jax.native.ffi import status as ffi_status  # noqa: E402

HIDDEN, FFN, EXPERTS, TOP_K = 64, 64, 8, 2


def tiny_layer(threads: int) -> FusedForward:
    rng = np.random.default_rng(0)
    w13 = (rng.standard_normal((EXPERTS, HIDDEN, 2 * FFN)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((EXPERTS, FFN, HIDDEN)) * 0.1).astype(np.float32)
    store = ExpertStore({0: LayerExperts(w13, w2)})
    kernel, why = best_kernel(np.float32)
    if not kernel:
        raise SystemExit(f"no fused forward kernel here: {why}")
    fused = FusedForward(store, lambda layer: pack_layer(store[layer], kernel), threads=threads, kernel=kernel)
    fused.prepare([0])
    return fused


def percentiles(seconds: list[float]) -> dict:
    us = np.array(seconds) * 1e6
    return {
        "median_us": float(np.median(us)),
        "p10_us": float(np.percentile(us, 10)),
        "p90_us": float(np.percentile(us, 90)),
    }


def _device_side(worker: StreamWorker, site: int, runs: int, seconds: list[float]):
    """Posts `site`'s go and waits for its done, `runs` times, appending each round trip."""
    for _ in range(runs):
        start = time.perf_counter()
        worker.post(site)
        worker.wait(site)
        seconds.append(time.perf_counter() - start)


def protocol_round_trip(fused: FusedForward, runs: int) -> list[dict]:
    rows = []
    worker = StreamWorker()
    for tokens in (0, 1):
        site = worker.site(fused.call_address(0), 0, 0, tokens, HIDDEN, TOP_K, np.float32, np.float32)
        x, ids, weights, _ = worker.staging(site, tokens, HIDDEN, TOP_K, np.float32, np.float32)
        x[...], ids[...], weights[...] = 0.5, 1, 0.5
        seconds = []
        thread = threading.Thread(target=_device_side, args=(worker, site, runs, seconds))
        thread.start()
        thread.join()
        rows.append({"tokens": tokens, "calls": runs, **percentiles(seconds[runs // 10 :])})
    worker.stop()
    return rows


def step_functions(fused: FusedForward, layers: int) -> dict:
    """ffi / stream / callback: a jitted step of `layers` chained calls of the layer (the handlers registered)."""
    usable, why = stream_experts.status()
    if not usable:
        raise SystemExit(f"stream calls unavailable: {why}")
    worker = StreamWorker(memory="cuda" if stream_experts.platform_name() == "cuda" else "host")
    address = fused.call_address(0)
    ids_np, weights_np = np.array([[1, 3]], np.int32), np.array([[0.5, 0.5]], np.float32)  # the callback's: numpy only
    ids, weights = jnp.asarray(ids_np), jnp.asarray(weights_np)

    def chained(call):
        def step(x):
            for _ in range(layers):
                x = x + call(x)
            return x

        return jax.jit(step)

    def callback(x):
        return jax.pure_callback(
            lambda x: fused.forward(0, np.asarray(x), ids_np, weights_np),
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            x,
            vmap_method="sequential",
        )

    slots = iter(range(1 << 30))

    def stream(signal):
        def call(x):
            site = stream_experts.StreamCall(worker.address, address, 0, next(slots) % stream_experts.SLOTS, signal)
            return stream_experts.host_experts_call(site, x, ids, weights)

        return call

    # on CUDA both signal forms (the plan's default is memops where the GPU runs them); on XLA:CPU they are the same
    signals = stream_experts.SIGNALS if stream_experts.platform_name() == "cuda" else ("host-functions",)
    steps = {f"stream ({signal})": chained(stream(signal)) for signal in signals}
    steps["callback"] = chained(callback)
    if ffi_status()[0]:
        steps["ffi"] = chained(lambda x: native_experts.host_experts_call(address, x, ids, weights))
    return steps, worker


def per_layer_overhead(fused: FusedForward, layers: int, rounds: int, calls: int) -> list[dict]:
    steps, worker = step_functions(fused, layers)
    x = jnp.full((1, HIDDEN), 0.01, jnp.float32)
    results = {name: [] for name in steps}
    for step in steps.values():
        jax.block_until_ready(step(x))  # compile
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(steps[name](x))
            results[name].append((time.perf_counter() - start) / calls / layers)
    outputs = {name: np.asarray(step(x)) for name, step in steps.items()}
    reference = next(iter(outputs.values()))
    rows = [
        {
            "host call": name,
            "per layer us (median)": statistics.median(seconds) * 1e6,
            "lowest round us": min(seconds) * 1e6,
            "same output": bool(np.allclose(outputs[name], reference, rtol=1e-5, atol=1e-6)),
        }
        for name, seconds in results.items()
    ]
    worker.stop()
    return rows


def report(args, protocol, overhead) -> Path:
    flags = ", ".join(name for name, present in cpu_features().items() if present) or "no listed flags"
    lines = [
        "# Host expert hand-off: the stream worker's round trip and per-layer call overhead",
        "",
        f"{datetime.date.today()}, commit {short_commit()}, CPU {cpu_model()} ({flags}), jax {jax.__version__} "
        f"on {jax.default_backend()}, the fused forward on {args.threads} thread(s); `python bench/stream_calls.py "
        f"--layers {args.layers} --rounds {args.rounds} --runs {args.runs} --threads {args.threads}`.",
        "",
        "## Protocol round trip (go -> done, a device thread against the worker), microseconds",
        "",
        "| tokens | median | p10 | p90 |",
        "|---|---|---|---|",
        *(f"| {r['tokens']} | {r['median_us']:.1f} | {r['p10_us']:.1f} | {r['p90_us']:.1f} |" for r in protocol),
        "",
        f"## Per-layer overhead in a jitted step ({args.layers} chained 1-token layers, XLA:CPU), microseconds",
        "",
        "| host call | median | lowest round | same output |",
        "|---|---|---|---|",
        *(
            f"| {r['host call']} | {r['per layer us (median)']:.1f} | {r['lowest round us']:.1f} | {r['same output']} |"
            for r in overhead
        ),
        "",
    ]
    return write_report("stream_calls", lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2000, help="round trips per protocol measurement")
    parser.add_argument("--calls", type=int, default=20, help="jitted steps per round")
    parser.add_argument("--threads", type=int, default=1, help="the fused forward's threads")
    args = parser.parse_args()
    fused = tiny_layer(args.threads)
    protocol = protocol_round_trip(fused, args.runs)
    print_table("protocol round trip (go -> done)", protocol)
    overhead = per_layer_overhead(fused, args.layers, args.rounds, args.calls)
    print_table(f"per-layer host call overhead in a jitted step of {args.layers} layers", overhead)
    write_json("stream_calls", {"protocol": protocol, "per_layer": overhead, "args": vars(args)})
    report(args, protocol, overhead)


if __name__ == "__main__":
    main()
