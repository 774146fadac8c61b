"""Every backend side by side on the same model and batch: forward and forward+backward (LoRA) time, and metrics.

    python bench/backends.py [--batch 4 --seq 512] [--repeats 3] [--quick] [--backends host,auto,host,auto]
        [--profile probe.json]

Runs unchanged on CPU and on an accelerator (the device lane is whatever `jax.devices()[0]` is). Uses the
Mixtral-shaped bench model (bench/models.py), LoRA r=8 on q/k/v/o; the hybrid plan keeps half of each layer's
experts on the device; auto gets room for half the experts (its cache, calibrated on the batch, and its stream
buffers) and plans with this machine's probe profile (or --profile's). A backend named twice runs twice, in
the order given: interleave them (host,auto,host,auto) to compare two on a noisy machine.
Writes bench/results/backends.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.common import print_table, timed, write_json  # noqa: E402
from bench.models import bench_model_dir  # noqa: E402
from moe_jax.model.lora import LoRAConfig  # noqa: E402
from moe_jax.train.objective import lora_value_and_grad  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="device,host,offload,hybrid,auto")
    parser.add_argument("--quick", action="store_true", help="batch 2 x 128, one repeat")
    parser.add_argument("--profile", type=Path, help="auto's probe profile (default: this machine's, cached)")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 128, 1
    path = bench_model_dir()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4096, size=(args.batch, args.seq)).astype(np.int32)
    mask = np.ones_like(tokens)
    print(f"device: {jax.devices()[0]}; batch {args.batch} x {args.seq} tokens")
    rows, metrics = [], {}
    for backend in args.backends.split(","):
        kwargs = {}
        if backend == "hybrid":
            kwargs["device_experts"] = {layer: [0, 1, 2, 3] for layer in range(4)}
        if backend == "auto":  # a probe profile; room for half the experts (cache + streams)
            kwargs["device_budget_bytes"] = 16 * 3 * 512 * 1408 * 4
            kwargs["profile"] = args.profile
        model = moe_jax.load_model(path, backend=backend, **kwargs)
        if backend == "auto":
            print(model.placement.describe())
            model.calibrate_expert_cache(tokens[:1])
        model.attach_lora(LoRAConfig(rank=8, alpha=16))
        fwd = timed(lambda m=model: m.logits(tokens), args.repeats)
        model.metrics()
        model.logits(tokens)
        fwd_metrics = model.metrics().summary()
        step, lora_state = lora_value_and_grad(model)
        fwd_bwd = timed(lambda s=step, st=lora_state: jax.block_until_ready(s(st, tokens, mask)), args.repeats)
        model.metrics()
        jax.block_until_ready(step(lora_state, tokens, mask))
        step_metrics = model.metrics().summary()
        n = tokens.size
        rows.append(
            {
                "backend": backend,
                "fwd_s": fwd,
                "fwd_tok_s": n / fwd,
                "fwd_bwd_s": fwd_bwd,
                "fwd_bwd_tok_s": n / fwd_bwd,
                "h2d_MB_step": step_metrics["host_to_device_MB"],
                "host_busy_s": step_metrics["host_busy_s"],
                "device_wait_s": step_metrics["device_wait_s"],
                "host_wait_s": step_metrics["host_wait_s"],
                "host_GFLOPs": step_metrics["host_gflops"],
                "host_weight_GBs": step_metrics["host_weight_gbps"],
            }
        )
        metrics[backend] = {"forward": fwd_metrics, "forward_backward": step_metrics}
    base = next((r for r in rows if r["backend"] == "device"), None)
    if base:
        for r in rows:
            r["speedup_vs_device_fwd_bwd"] = base["fwd_bwd_s"] / r["fwd_bwd_s"]
    print_table("backends (same model, batch, LoRA r=8 on q/k/v/o)", rows)
    write_json("backends", {"batch": args.batch, "seq": args.seq, "rows": rows, "metrics": metrics})


if __name__ == "__main__":
    main()
