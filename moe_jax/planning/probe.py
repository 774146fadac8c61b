"""`python -m moe_jax.probe [--model DIR] [--out FILE]`: this machine's figures for choosing where experts compute.

How it works and why: docs/INTERNALS.md, moe_jax/planning/probe.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import threading
import timeit
from pathlib import Path

import numpy as np

from host_kernels import ExpertStore, HostMoE, LayerExperts, default_threads
from moe_jax.backends.offload import memory_sharding
from moe_jax.formats.checkpoint import open_checkpoint
from moe_jax.model.moe import DeviceExperts
from moe_jax.planning import environment
from moe_jax.planning.cost_model import Profile

ROWS = (1, 2, 4, 8, 16, 64, 256, 1024)
QUICK_ROWS = (1, 4, 16, 64, 256)


def _median_time(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` timed runs after a warm-up: one lucky or unlucky run (another
    process on the shared cores) moves a minimum or a mean, not the median."""
    fn()
    return float(np.median(timeit.repeat(fn, number=1, repeat=repeats)))


def expert_shape(model_dir) -> tuple[int, int]:
    if model_dir is None:
        return 512, 1408

    config = open_checkpoint(model_dir).config
    return config.hidden_size, config.expert_intermediate_size


def probe_bus(d: int, f: int, repeats: int, copies: int = 4) -> dict:
    """Seconds to copy `copies` experts (fresh buffers each, so nothing is cached on the device) host->device."""
    import jax

    host, device = memory_sharding("pinned_host"), memory_sharding("device")
    rng = np.random.default_rng(0)
    buffers = [jax.device_put(rng.standard_normal((3 * d * f,), np.float32), host) for _ in range(copies)]
    move = jax.jit(lambda bufs: [jax.device_put(b, device) for b in bufs])
    seconds = _median_time(lambda: jax.block_until_ready(move(buffers)), repeats)
    nbytes = sum(b.nbytes for b in buffers)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}


def _expert_table(
    run, d, f, rows: tuple[int, ...], repeats: int, seed: int, prepare=lambda *a: a
) -> tuple[list, float]:
    """Per-expert seconds at each size and the fixed cost of one call, for a layer function `run(x, ids, w)`
    (blocking; its inputs made by `prepare` outside the timing) over 8 experts.

    Times T8(n) of 8 experts with n rows each and T2 of one decode token (top-2: 2 experts, 1 row) fit
    T = call + experts x per-expert: call = (4 T2 - T8(1)) / 3 and per-expert(n) = (T8(n) - call) / 8. (A single
    one-row expert would not do: the scheduler splits it by columns, which costs extra.)"""
    rng = np.random.default_rng(seed)
    totals = []
    for n in rows:
        x = rng.standard_normal((n * 8, d)).astype(np.float32)
        ids = np.repeat(np.arange(8), n)[:, None]  # n rows for each of the 8 experts
        args = prepare(x, ids, np.ones_like(ids, np.float32))
        totals.append(_median_time(lambda args=args: run(*args), repeats))
    x = rng.standard_normal((1, d)).astype(np.float32)
    decode = []
    for pair in ([0, 1], [3, 6], [5, 2], [7, 4]):  # the median over expert pairs: some layouts run slower
        args = prepare(x, np.array([pair]), np.full((1, 2), 0.5, np.float32))
        decode.append(_median_time(lambda args=args: run(*args), repeats))
    decode = float(np.median(decode))
    one_row = totals[rows.index(1)] if 1 in rows else totals[0]
    call = max(0.0, (4 * decode - one_row) / 3)
    table = []
    for n, total in zip(rows, totals, strict=True):
        seconds = max(total - call, 1e-9) / 8
        table.append(
            {
                "rows": n,
                "seconds": seconds,
                "gflops": 6 * n * d * f / seconds / 1e9,
                "weight_gbps": 12 * d * f / seconds / 1e9,
            }
        )
    return table, call


def probe_host(d: int, f: int, rows: tuple[int, ...], repeats: int, threads: int | None) -> tuple[list[dict], float]:
    """host_kernels over 8 experts (so that decode-size calls read weights from RAM, as in a real step)."""
    rng = np.random.default_rng(1)
    layer = LayerExperts(
        (rng.standard_normal((8, d, 2 * f)) / np.sqrt(d)).astype(np.float32),
        (rng.standard_normal((8, f, d)) / np.sqrt(f)).astype(np.float32),
    )
    engine = HostMoE(ExpertStore({0: layer}), threads=threads)
    return _expert_table(lambda x, ids, w: engine.forward(0, x, ids, w), d, f, rows, repeats, seed=3)


def probe_device(d: int, f: int, rows: tuple[int, ...], repeats: int) -> tuple[list[dict], float]:
    """The device backend's layer (expert-sorted ragged_dot) over 8 resident experts."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    experts = DeviceExperts(
        jnp.asarray(rng.standard_normal((8, d, 2 * f)) / np.sqrt(d), jnp.float32),
        jnp.asarray(rng.standard_normal((8, f, d)) / np.sqrt(f), jnp.float32),
    )
    layer = jax.jit(lambda x, ids, w: experts(x, ids, w))

    def prepare(x, ids, w):
        return jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(w)

    return _expert_table(lambda *args: layer(*args).block_until_ready(), d, f, rows, repeats, seed=4, prepare=prepare)


def probe_both(d: int, f: int, repeats: int, threads: int | None) -> dict:
    """Host expert work and bus copies at the same time: each side's rate while the other runs."""
    stop = threading.Event()
    bus_results = []

    def copy_loop():
        while not stop.is_set():
            bus_results.append(probe_bus(d, f, 1))

    worker = threading.Thread(target=copy_loop, daemon=True)
    worker.start()
    try:
        host, _ = probe_host(d, f, (1, 64), repeats, threads)
    finally:
        stop.set()
        worker.join()
    return {"host": host, "bus_gbps": float(np.median([r["gbps"] for r in bus_results])) if bus_results else None}


def probe_callback(d: int, repeats: int, calls: int = 8) -> float:
    """Seconds one `pure_callback` adds to a jitted step on this device, with [16, d] float32 activations each
    way: a chain of `calls` of them against the same chain without."""
    import jax
    import jax.numpy as jnp

    def chain(x, with_callbacks: bool):
        for _ in range(calls):
            if with_callbacks:
                x = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            x = x * 1.0001
        return x

    x = jnp.ones((16, d), jnp.float32)
    steps = [jax.jit(functools.partial(chain, with_callbacks=with_callbacks)) for with_callbacks in (True, False)]
    runs = [lambda step=step: step(x).block_until_ready() for step in steps]
    for run in runs:
        run()  # compiled and warm
    # timed alternately, the fastest of each side: a busy stretch of the shared cores only ever adds time, so the
    # minimums are the two chains' own costs (the median of paired differences came out <= 0 under CI's parallel
    # tests, a callback costing nothing; two medians timed one side after the other had done the same)
    seconds = np.array([[timeit.timeit(run, number=1) for run in runs] for _ in range(max(repeats, 9))])
    with_callbacks, without = seconds.min(axis=0)
    return max(0.0, float(with_callbacks - without) / calls)


def probe_device_dense(d: int, f: int, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """Seconds of x [rows, d] @ W [d, 3f] on the device, float32 (as the expert tables)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((d, 3 * f)) / np.sqrt(d), jnp.float32)
    product = jax.jit(lambda x: x @ w)
    table = []
    for n in rows:
        x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
        seconds = _median_time(lambda x=x: product(x).block_until_ready(), repeats)
        table.append({"rows": n, "seconds": seconds, "gflops": 6 * n * d * f / seconds / 1e9})
    return table


def measure(d: int, f: int, rows: tuple[int, ...], repeats: int, threads: int | None) -> dict:
    """The whole profile for experts of shape (d, f): bus, host, device, both at once."""
    import jax

    profile = {
        "machine": {"platform": platform.platform(), "jax_device": str(jax.devices()[0])},
        "expert": {"hidden": d, "ffn": f, "bytes": 3 * d * f * 4, "dtype": "float32"},
        "bus": probe_bus(d, f, repeats),
    }
    profile["host"], profile["host_call_s"] = probe_host(d, f, rows, repeats, threads)
    profile["host_threads"] = threads or default_threads()
    profile["device"], profile["device_call_s"] = probe_device(d, f, rows, repeats)
    profile["both"] = probe_both(d, f, repeats, threads)
    profile["parallel_lanes"] = jax.devices()[0].platform != "cpu"  # a CPU "device" shares the host's cores
    profile["callback_s"] = probe_callback(d, repeats)
    profile["device_dense"] = probe_device_dense(d, f, rows, repeats)
    return profile


def cached_profile(d: int, f: int):
    """This machine's profile for experts of shape (d, f): measured once (quick sizes), then read from
    ~/.cache/moe_jax (or $MOE_JAX_CACHE)."""
    cache = environment.cache_dir()
    path = cache / f"probe-{d}x{f}-{default_threads()}threads.json"
    if not path.exists():
        print(f"measuring this machine for backend='auto' (once; kept in {path}) ...", file=sys.stderr)
        profile = measure(d, f, QUICK_ROWS, 5, None)
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two processes measuring at once both land
        partial.write_text(json.dumps(profile, indent=1))
        partial.replace(path)
    return Profile.load(path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m moe_jax.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="take the expert shape from this checkpoint")
    parser.add_argument("--out", type=Path, default=Path("probe.json"))
    parser.add_argument("--threads", type=int, help="host expert engine threads (default: all cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("HIDDEN", "FFN"), help="expert shape (no --model)")
    args = parser.parse_args(argv)
    d, f = tuple(args.shape) if args.shape else expert_shape(args.model)
    profile = measure(d, f, QUICK_ROWS if args.quick else ROWS, args.repeats, args.threads)
    args.out.write_text(json.dumps(profile, indent=1))
    print(f"expert {d} x {f} ({profile['expert']['bytes'] / 2**20:.1f} MiB), device {profile['machine']['jax_device']}")
    print(
        f"bus host->device: {profile['bus']['gbps']:.2f} GB/s alone, "
        f"{profile['both']['bus_gbps'] or float('nan'):.2f} GB/s while the host computes"
    )
    print(
        f"{'rows':>6} {'host us':>10} {'host GFLOP/s':>13} {'host GB/s':>10} {'device us':>10} {'device GFLOP/s':>15}"
    )
    for h, dv in zip(profile["host"], profile["device"], strict=True):
        print(
            f"{h['rows']:>6} {h['seconds'] * 1e6:>10.0f} {h['gflops']:>13.1f} {h['weight_gbps']:>10.2f} "
            f"{dv['seconds'] * 1e6:>10.0f} {dv['gflops']:>15.1f}"
        )
    both = profile["both"]["host"]
    print("host while copying: " + ", ".join(f"{b['rows']} rows {b['weight_gbps']:.2f} GB/s" for b in both))
    print(
        f"fixed cost per layer call: host {profile['host_call_s'] * 1e6:.0f} us, "
        f"device {profile['device_call_s'] * 1e6:.0f} us; a host callback from a jitted step "
        f"{profile['callback_s'] * 1e6:.0f} us"
    )
    dense = profile["device_dense"]
    print("device dense products: " + ", ".join(f"{r['rows']} rows {r['gflops']:.1f} GFLOP/s" for r in dense))
    print(f"wrote {args.out}")
