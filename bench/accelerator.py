"""The accelerator run (bench/accelerator.sh runs it): every backend on a Qwen3-30B-A3B-shaped model beside a GPU.

    python bench/accelerator.py [--layers 4] [--quick] [--out DIR]

The model has Qwen3-30B-A3B's real layer dims (hidden 2048, 128 experts of ffn 768, top-8, 32 query / 4 KV heads
of 128; bench/models.py) cut to `--layers` layers, bfloat16, experts on the host. Each side runs in its own
process with a time limit: the probe of this machine (its JSON kept), then moe_jax's host backend without and
with the micro-batch pipeline, offload and auto with 10 GB of device memory for experts, the device backend
(every expert in device memory), and transformers + peft on CUDA where torch sees a GPU. Each side: a forward of
4 x 512 tokens, a LoRA training step (r=8 on attention, 2 x 512), and generation at batch 1 and 16 (32-token
prompts, 32 new tokens); per step the host lane's busy fraction (host wall seconds of its expert calls / step)
and the device lane's (1 - the seconds the step waited on the host / step). Writes accelerator.json to --out
(default bench/results). On a machine without an accelerator it runs the same, with jax's CPU as the device
(`--quick` for a smoke run of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, machine_info  # noqa: E402
from bench.models import bench_model_dir, use_shape  # noqa: E402

DEVICE_MEMORY_FOR_EXPERTS = 10 * 10**9
SIDES = ("host", "host-pipelined", "offload", "auto", "device", "transformers-cuda")
SIDE_TIMEOUT_S = 65  # six sides, the probe and the model's making within accelerator.sh's 420 s


def sizes(quick: bool) -> dict:
    if quick:
        return dict(forward=(2, 64), train=(2, 64), new_tokens=4, prompt=16, batches=(1, 4))
    return dict(forward=(4, 512), train=(2, 512), new_tokens=32, prompt=32, batches=(1, 16))


def busy(metrics: dict, seconds: float) -> dict:
    return {
        "host_busy": metrics["host_wall_s"] / seconds if seconds else None,
        "device_busy": max(0.0, 1.0 - metrics["device_wait_s"] / seconds) if seconds else None,
    }


def moe_jax_side(side: str, path: Path, size: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moe_jax
    from bench.infer import engine_runner
    from moe_jax.model.lora import LoRAConfig
    from moe_jax.train.objective import lora_value_and_grad

    backend = side.split("-")[0]
    kwargs = {"pipeline": 2 if side == "host-pipelined" else 1} if backend == "host" else {}
    if backend in ("offload", "auto"):
        kwargs["device_budget_bytes"] = DEVICE_MEMORY_FOR_EXPERTS
    model = moe_jax.load_model(path, backend=backend, dtype="bfloat16", **kwargs)
    out = {"plan": model.plan.lines(), "placement": getattr(model.placement, "describe", lambda: backend)()}
    rng = np.random.default_rng(0)

    def timed(fn, repeats=3):
        fn()
        model.metrics()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return {"step_s": float(np.median(seconds)), **busy(model.metrics().summary(), sum(seconds))}

    rows, seq = size["forward"]
    ids = rng.integers(0, 4096, size=(rows, seq))
    out["forward"] = timed(lambda: model.logits(ids))
    out["forward"]["tokens_per_s"] = rows * seq / out["forward"]["step_s"]
    model.attach_lora(LoRAConfig(rank=8, alpha=16, targets=("attention",)))
    value_and_grad, lora_state = lora_value_and_grad(model)
    rows, seq = size["train"]
    tokens = jnp.asarray(rng.integers(0, 4096, size=(rows, seq)))
    mask = jnp.ones_like(tokens)
    out["train"] = timed(lambda: jax.block_until_ready(value_and_grad(lora_state, tokens, mask)))
    out["train"]["tokens_per_s"] = rows * seq / out["train"]["step_s"]
    for batch in size["batches"]:
        run = engine_runner(model, batch, size["new_tokens"], size["prompt"])
        model.metrics()
        start = time.perf_counter()
        result = run()
        out[f"decode_b{batch}"] = {**result, **busy(model.metrics().summary(), time.perf_counter() - start)}
    return out


def transformers_side(path: Path, size: dict) -> dict:
    import peft
    import torch
    import transformers

    if not torch.cuda.is_available():
        return {"skipped": f"torch {torch.__version__} sees no CUDA device"}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    rows, seq = size["forward"]
    ids = torch.randint(0, 4096, (rows, seq), device="cuda")

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.no_grad():
        forward = timed(lambda: model(ids, logits_to_keep=1))
    out = {"forward": {"step_s": forward, "tokens_per_s": rows * seq / forward}}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    rows, seq = size["train"]
    train_ids = torch.randint(0, 4096, (rows, seq), device="cuda")
    step = timed(lambda: lora(input_ids=train_ids, labels=train_ids).loss.backward())
    out["train"] = {"step_s": step, "tokens_per_s": rows * seq / step}
    model = lora.unload()  # the base model again, for generation
    new = size["new_tokens"]
    for batch in size["batches"]:
        prompts = torch.randint(16, 4096, (batch, size["prompt"]), device="cuda")
        settings = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            seconds = timed(lambda prompts=prompts, settings=settings: model.generate(prompts, **settings))
        out[f"decode_b{batch}"] = {"end_to_end_tok_s": batch * new / seconds}
    return out


def child(side: str, path: Path, quick: bool):
    size = sizes(quick)
    result = transformers_side(path, size) if side == "transformers-cuda" else moe_jax_side(side, path, size)
    print("RESULT " + json.dumps(result, default=float))


def run_side(side: str, path: Path, quick: bool) -> dict:
    command = [sys.executable, __file__, "--child", side, "--model", str(path)] + (["--quick"] if quick else [])
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SIDE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"over {SIDE_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-3:]}
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "wall_s": time.perf_counter() - start}


def summary(result: dict) -> str:
    """One line per side: tokens/s of each case, or why it has none."""
    if "error" in result or "skipped" in result:
        return f"  {result.get('error') or result.get('skipped')}"
    cases = [k for k in result if k in ("forward", "train") or k.startswith("decode_b")]
    speeds = {
        k: result[k].get("tokens_per_s") or result[k].get("decode_tok_s") or result[k].get("end_to_end_tok_s")
        for k in cases
    }
    return "  " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in speeds.items() if v)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model, args.quick)
    import jax

    use_shape("qwen3-30b-a3b")
    path = bench_model_dir(layers=args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    probe = args.out / "accelerator_probe.json"
    subprocess.run(
        [sys.executable, "-m", "moe_jax.probe", "--shape", "2048", "768", "--quick", "--out", str(probe)], check=True
    )
    report = {
        "machine": machine_info(),
        "jax_devices": [str(d) for d in jax.devices()],
        "layers": args.layers,
        "probe": json.loads(probe.read_text()),
        "sides": {},
    }
    for side in args.sides.split(","):
        print(f"{side} ...", flush=True)
        report["sides"][side] = run_side(side, path, args.quick)
        print(summary(report["sides"][side]), flush=True)
        (args.out / "accelerator.json").write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {args.out / 'accelerator.json'}")


if __name__ == "__main__":
    main()
