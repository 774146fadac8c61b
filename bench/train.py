"""LoRA fine-tuning throughput: this project (host and device backends) against transformers + peft on torch CPU.

    python bench/train.py [--steps 5] [--batch 4 --seq 512] [--rounds 1] [--quick] [--sides moe_jax-host-bfloat16,...]

Same bench model (bench/models.py; --shape), same random token batches, LoRA r=8 alpha=16 on the attention
projections (q/k/v/o; DeepSeek: the latent attention's), AdamW, each side in float32 and in bfloat16 (base weights
and activations; adapters and optimizer state stay float32 on both sides, as peft keeps them by default), and
moe_jax also on int8 and int4 experts (bfloat16 otherwise: LoRA on a quantized base). Each side runs in its own
process (so peak RSS is its own), two warm-up steps, then `--steps` timed steps; with `--rounds`, the sides
alternate that many times and each side's figure is the median over all its rounds' steps. Prints a table with
each side's speed against transformers+peft in its faster dtype of this run, and writes bench/results/train.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info, print_table, write_json  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402

DTYPES = ("float32", "bfloat16")
QUANTS = ("int8", "int4", "mxfp4")  # moe_jax's host experts quantized (bfloat16 otherwise): LoRA on a quantized base
SIDES = tuple(f"{side}-{dtype}" for side in ("moe_jax-host", "moe_jax-device", "transformers+peft") for dtype in DTYPES)
SIDES += tuple(f"moe_jax-host-{quant}" for quant in QUANTS)


def batches(batch, seq, count):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, 4096, size=(batch, seq)).astype(np.int32) for _ in range(count)]  # in every shape's vocab


def run_moe_jax(backend, dtype, batch, seq, steps, quant=None, checkpoint=None, threads=None):
    """`steps` timed LoRA steps after two warm-up ones on `checkpoint` (default: the bench model): (their seconds,
    every step's loss, the model's metrics summary)."""
    import jax
    import numpy as np
    import optax

    import moe_jax
    from moe_jax.model.lora import LoRAConfig
    from moe_jax.train.objective import lora_value_and_grad

    source = checkpoint or bench_model_dir()
    model = moe_jax.load_model(source, backend=backend, dtype=dtype, quant=quant, host_threads=threads)
    model.attach_lora(LoRAConfig(rank=8, alpha=16, targets=("attention",)))  # q/k/v/o, or the latent attention's
    value_and_grad, lora_state = lora_value_and_grad(model)
    tx = optax.adamw(1e-4)
    opt_state = tx.init(lora_state)

    @jax.jit
    def update(lora_state, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, lora_state)
        return optax.apply_updates(lora_state, updates), opt_state

    data = batches(batch, seq, steps + 2)
    mask = np.ones_like(data[0])
    times, losses = [], []
    model.metrics()
    for i, tokens in enumerate(data):
        start = time.perf_counter()
        loss, grads = value_and_grad(lora_state, tokens, mask)
        lora_state, opt_state = update(lora_state, opt_state, grads)
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
        if i == 1:
            model.metrics()  # count the timed steps only
    metrics = model.metrics().summary()
    return times[2:], losses, metrics


def run_transformers(dtype, batch, seq, steps):
    import peft
    import torch
    import transformers

    from moe_jax.formats.hf_config import read_hf_config
    from moe_jax.model.lora import attention_targets

    targets = attention_targets(read_hf_config(json.loads((bench_model_dir() / "config.json").read_text())))
    model = transformers.AutoModelForCausalLM.from_pretrained(bench_model_dir(), dtype=getattr(torch, dtype))
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times, losses = [], []
    for tokens in batches(batch, seq, steps + 2):
        start = time.perf_counter()
        ids = torch.from_numpy(tokens).long()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return times[2:], losses, {}


def child(side, batch, seq, steps):
    name, dtype = side.rsplit("-", 1)
    quant = dtype if dtype in QUANTS else None
    if name == "transformers+peft":
        times, losses, metrics = run_transformers(dtype, batch, seq, steps)
    else:
        backend = name.split("-")[1]
        times, losses, metrics = run_moe_jax(backend, "bfloat16" if quant else dtype, batch, seq, steps, quant)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "losses": losses, "metrics": metrics, "peak_rss_mb": peak_mb}))


def run_child(side: str, args) -> dict:
    """One side's steps in a process of its own: {times, losses, metrics, peak_rss_mb}."""
    cmd = [sys.executable, __file__, "--child", side, "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--steps", str(args.steps), "--shape", args.shape]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every side, alternating (medians over all)")
    parser.add_argument("--quick", action="store_true", help="batch 2 x 128, 2 steps")
    default_sides = [side for side in SIDES if not side.endswith("mxfp4")]  # GPT-OSS's format: asked for by name
    parser.add_argument(
        "--sides", default=",".join(default_sides), help="comma-separated subset of " + ", ".join(SIDES)
    )
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    add_shape_argument(parser)
    args = parser.parse_args()
    use_shape(args.shape)
    if args.quick:
        args.batch, args.seq, args.steps = 2, 128, 2
    if args.child:
        return child(args.child, args.batch, args.seq, args.steps)
    bench_model_dir()  # made once, outside the timed processes
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown side(s) {unknown}; choose from {', '.join(SIDES)}")
    raw = {side: [] for side in sides}  # one child's result per round
    for round_ in range(args.rounds):  # A B A B: a slow minute of the machine falls on every side alike
        for side in sides:
            result = run_child(side, args)
            raw[side].append(result)
            median = statistics.median(result["times"])
            print(
                f"round {round_ + 1}: {side}: {args.batch * args.seq / median:,.0f} tokens/s ({median:.2f} s a step)",
                file=sys.stderr,
            )
    rows = []
    for side, results in raw.items():
        median = statistics.median([t for r in results for t in r["times"]])  # over every round's timed steps
        metrics = [r["metrics"] for r in results]
        rows.append(
            {
                "side": side,
                "step_s": median,
                "tokens_per_s": args.batch * args.seq / median,
                "peak_rss_MB": max(r["peak_rss_mb"] for r in results),
                "first_loss": results[0]["losses"][0],
                "host_busy_s_per_step": sum(m.get("host_busy_s", 0) for m in metrics) / (args.steps * len(results)),
                "device_wait_s_per_step": sum(m.get("device_wait_s", 0) for m in metrics) / (args.steps * len(results)),
            }
        )
    reference = [r["tokens_per_s"] for r in rows if r["side"].startswith("transformers")]
    ref = max(reference) if reference else float("nan")  # transformers+peft in its faster dtype
    for r in rows:
        r["vs_transformers"] = r["tokens_per_s"] / ref
    print(machine_info())
    print_table(f"LoRA fine-tuning, batch {args.batch} x {args.seq}, r=8 on the attention projections", rows)
    write_json(
        f"train-{args.shape}" if args.shape != "bench" else "train",
        {
            "shape": args.shape,
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "rounds": args.rounds,
            "rows": rows,
            "raw": raw,
        },
    )


if __name__ == "__main__":
    main()
