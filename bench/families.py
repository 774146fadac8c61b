"""DeepSeek-class models against transformers on torch CPU: a DeepSeek-V2-Lite-shaped model, side by side.

    python bench/families.py [--dtypes float32,bfloat16] [--rounds 2] [--step-seq 512 --steps 3] [--quick]

The model: DeepSeek-V2-Lite's real dims cut to 4 layers (bench/models.py, shape deepseek-v2-lite: hidden 2048,
64 routed experts of 1408 + 2 shared, top-6, latent attention with kv_lora_rank 512 and 16 heads of 128 + 64).
Per dtype, tokens/s of: a forward (prefill) of one 512-token prompt; a LoRA training step (batch 1 x --step-seq,
r=8 on the latent attention's projections, AdamW; median of --steps after two warm-up steps); decode at batch 1
and 16 (32-token prompts, 32 new tokens, end to end). For moe_jax's host backend and for transformers (+ peft for
the step). Each side and dtype runs in its own process (two ~1.8B-parameter models at once do not fit in 24 GB),
the sides alternating A B A B over --rounds; the table holds medians and moe_jax / transformers. Writes
bench/results/families.json. (transformers' bfloat16 step on a CPU without AVX512-BF16 or AMX takes minutes:
--step-seq 128 --steps 1 keeps a run near 20 minutes there.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info, print_table, write_json  # noqa: E402
from bench.models import bench_model_dir, use_shape  # noqa: E402

SHAPE = "deepseek-v2-lite"
PROMPT, NEW, PREFILL, SEQ = 32, 32, 512, 512
SIDES = ("moe_jax", "transformers")
MEASURES = ("prefill", "lora_step", "decode_b1", "decode_b16")


def infer_child(side: str, dtype: str, new_tokens: int, prefill: int) -> dict:
    """tokens/s of one prefill and of decode at batch 1 and 16, in this process (one model loaded at a time)."""
    import gc

    import moe_jax
    from bench import infer

    model = moe_jax.load_model(bench_model_dir(), backend="host", dtype=dtype) if side == "moe_jax" else None
    result = {}
    for measure, batch, prompt, new in (
        ("decode_b1", 1, PROMPT, new_tokens),
        ("decode_b16", 16, PROMPT, new_tokens),
        ("prefill", 1, prefill, 0),
    ):
        if model is not None:
            run = infer.engine_runner(model, batch, new, prompt)
        else:
            run = infer.transformers_generate(batch, new, dtype, prompt=prompt)
        out = run()
        result[measure] = out["prefill_tok_s"] if not new else out["end_to_end_tok_s"]
        del run
        gc.collect()  # transformers loads its model per case: one at a time
    return result


def train_child(side: str, dtype: str, seq: int, steps: int) -> dict:
    """tokens/s of a LoRA step (median of `steps` after two warm-up steps) and the process's peak RSS."""
    name = f"moe_jax-host-{dtype}" if side == "moe_jax" else f"transformers+peft-{dtype}"
    cmd = [sys.executable, str(Path(__file__).with_name("train.py")), "--child", name, "--shape", SHAPE]
    cmd += ["--batch", "1", "--seq", str(seq), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return {"lora_step": seq / statistics.median(result["times"]), "train_peak_rss_MB": result["peak_rss_mb"]}


def run_side(side: str, dtype: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--dtypes", dtype]
    if args.quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{side} {dtype} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(train_child(side, dtype, args.step_seq, args.steps))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2, help="A B A B rounds per dtype (medians in the table)")
    parser.add_argument("--step-seq", type=int, default=SEQ, help="tokens of the LoRA step's one row")
    parser.add_argument("--steps", type=int, default=3, help="timed LoRA steps (after two warm-up steps)")
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 128-token prefill and step, one round")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_shape(SHAPE)
    new_tokens, prefill = (8, 128) if args.quick else (NEW, PREFILL)
    if args.quick:
        args.step_seq, args.steps = 128, 2
    if args.child:
        print(json.dumps(infer_child(args.child, args.dtypes, new_tokens, prefill)))
        return
    bench_model_dir()  # made once (a few minutes), outside the timed processes
    rounds = 1 if args.quick else args.rounds
    raw = {}
    for round_ in range(rounds):
        for dtype in args.dtypes.split(","):
            for side in SIDES:
                print(f"round {round_ + 1}/{rounds}: {side} {dtype}", flush=True)
                raw.setdefault(f"{side}_{dtype}", []).append(run_side(side, dtype, args))
    rows = []
    for dtype in args.dtypes.split(","):
        medians = {
            side: {m: statistics.median(r[m] for r in raw[f"{side}_{dtype}"]) for m in MEASURES} for side in SIDES
        }
        for side in SIDES:
            row = {"side": f"{side} {dtype}", **medians[side]}
            if side == "moe_jax":
                row.update({f"{m} x": medians[side][m] / medians["transformers"][m] for m in MEASURES})
            row["train_peak_rss_MB"] = max(r["train_peak_rss_MB"] for r in raw[f"{side}_{dtype}"])
            rows.append(row)
    print(machine_info())
    print_table(
        f"{SHAPE} (4 layers), tokens/s: prefill 1 x {prefill}, LoRA step 1 x {args.step_seq}, decode of "
        f"{PROMPT}-token prompts with {new_tokens} new tokens end to end; x: moe_jax / transformers",
        rows,
    )
    settings = {"new_tokens": new_tokens, "prefill": prefill, "step_seq": args.step_seq, "steps": args.steps}
    write_json("families", {"shape": SHAPE, "rounds": rounds, **settings, "rows": rows, "raw": raw})


if __name__ == "__main__":
    main()
