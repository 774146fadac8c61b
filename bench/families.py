"""The newer families against transformers on torch CPU, side by side on their real layer dims.

    python bench/families.py [--shape deepseek-v2-lite|gpt-oss-20b|minimax-m2|qwen3-next] [--dtypes float32,bfloat16]
        [--quant mxfp4] [--rounds 2] [--step-seq 512 --steps 3] [--quick]

The models (bench/models.py): DeepSeek-V2-Lite's real dims cut to 4 layers (latent attention, 64 routed experts of
1408 + 2 shared, top-6); gpt-oss-20b's cut to 2 layers (sinks, sliding and full attention, 32 experts of 2880 with
biases and the clamped SwiGLU, top-4); MiniMax-M2's cut to 1 layer (256 experts of 1536, top-8, sigmoid routing);
Qwen3-Next's cut to 2 layers (a Gated DeltaNet and a gated attention, 512 experts of 512 + a shared one, top-10).
Per dtype, tokens/s of: a forward (prefill) of one 512-token prompt; a LoRA training step (batch 1 x --step-seq,
r=8 on the attention's projections, AdamW; median of --steps after two warm-up steps); decode at batch 1 and 16
(32-token prompts, 32 new tokens, greedy and end to end: both sides decode the same tokens, so they route alike).
For moe_jax's host backend and for transformers (+ peft for the step); `--quant` adds moe_jax on experts in that
format (bfloat16 otherwise; gpt-oss-20b's release format: mxfp4), against transformers in bfloat16 (what it
computes MXFP4 experts in on a CPU). Each side and dtype runs in its own process, the sides alternating A B A B over
--rounds; the table holds medians and moe_jax / transformers. Writes bench/reports/families-SHAPE.md and
bench/results/families-SHAPE.json (-DTYPES-QUANT appended for other dtypes or a quantized side). (transformers'
bfloat16 on a CPU without AVX512-BF16 or AMX is slow beyond use, its step takes minutes: compare in float32 there,
or --step-seq 128 --steps 1 keeps a run near 20 minutes.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info, markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from bench.models import bench_model_dir, use_shape  # noqa: E402

SHAPES = ("deepseek-v2-lite", "gpt-oss-20b", "minimax-m2", "qwen3-next")
PROMPT, NEW, PREFILL, SEQ = 32, 32, 512, 512
SIDES = ("moe_jax", "transformers")
MEASURES = ("prefill", "lora_step", "decode_b1", "decode_b16")


def infer_child(side: str, dtype: str, new_tokens: int, prefill: int, quant: str | None) -> dict:
    """tokens/s of one prefill and of decode at batch 1 and 16, in this process (one model loaded at a time)."""
    import gc

    import moe_jax
    from bench import infer

    model = None
    if side == "moe_jax":
        model = moe_jax.load_model(bench_model_dir(), backend="host", dtype=dtype, quant=quant)
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


def train_child(side: str, dtype: str, seq: int, steps: int, shape: str, quant: str | None) -> dict:
    """tokens/s of a LoRA step (median of `steps` after two warm-up steps) and the process's peak RSS."""
    name = f"moe_jax-host-{quant or dtype}" if side == "moe_jax" else f"transformers+peft-{dtype}"
    cmd = [sys.executable, str(Path(__file__).with_name("train.py")), "--child", name, "--shape", shape]
    cmd += ["--batch", "1", "--seq", str(seq), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return {"lora_step": seq / statistics.median(result["times"]), "train_peak_rss_MB": result["peak_rss_mb"]}


def run_side(side: str, dtype: str, args, quant: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--dtypes", dtype, "--shape", args.shape]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--quant", quant] if quant else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{side} {dtype} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(train_child(side, dtype, args.step_seq, args.steps, args.shape, quant))
    return result


def runs(args) -> list[tuple[str, str, str | None]]:
    """(side, dtype, quant) of every process of one round: each dtype's pair, then the quantized moe_jax side."""
    out = [(side, dtype, None) for dtype in args.dtypes.split(",") for side in SIDES]
    return out + ([("moe_jax", "bfloat16", args.quant)] if args.quant else [])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default=SHAPES[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quant", help="also moe_jax on experts in this format (e.g. mxfp4 for gpt-oss-20b)")
    parser.add_argument("--rounds", type=int, default=2, help="A B A B rounds per dtype (medians in the table)")
    parser.add_argument("--step-seq", type=int, default=SEQ, help="tokens of the LoRA step's one row")
    parser.add_argument("--steps", type=int, default=3, help="timed LoRA steps (after two warm-up steps)")
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 128-token prefill and step, one round")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_shape(args.shape)
    new_tokens, prefill = (8, 128) if args.quick else (NEW, PREFILL)
    if args.quick:
        args.step_seq, args.steps = 128, 2
    if args.child:
        print(json.dumps(infer_child(args.child, args.dtypes, new_tokens, prefill, args.quant)))
        return
    bench_model_dir()  # made once (a few minutes), outside the timed processes
    rounds = 1 if args.quick else args.rounds
    raw = {}
    for round_ in range(rounds):
        for side, dtype, quant in runs(args):
            label = f"{side}_{quant or dtype}"
            print(f"round {round_ + 1}/{rounds}: {label}", flush=True)
            raw.setdefault(label, []).append(run_side(side, dtype, args, quant))

    def medians(label):
        return {m: statistics.median(r[m] for r in raw[label]) for m in MEASURES}

    rows = []
    for side, dtype, quant in runs(args):
        label, mine = f"{side}_{quant or dtype}", medians(f"{side}_{quant or dtype}")
        row = {"side": f"{side} {quant or dtype}", **mine}
        if side == "moe_jax":
            theirs = medians(f"transformers_{dtype}")
            row.update({f"{m} x": mine[m] / theirs[m] for m in MEASURES})
        row["train_peak_rss_MB"] = max(r["train_peak_rss_MB"] for r in raw[label])
        rows.append(row)
    title = (
        f"{args.shape}, tokens/s: prefill 1 x {prefill}, LoRA step 1 x {args.step_seq}, decode of {PROMPT}-token "
        f"prompts with {new_tokens} new tokens end to end (greedy); x: moe_jax / transformers in the same dtype "
        "(bfloat16 for a quantized side)"
    )
    print(machine_info())
    print_table(title, rows)
    settings = {"new_tokens": new_tokens, "prefill": prefill, "step_seq": args.step_seq, "steps": args.steps}
    name = "families" if args.shape == SHAPES[0] else f"families-{args.shape}"
    if args.dtypes != "float32,bfloat16" or args.quant:  # a partial run: its own report
        name += "-" + "-".join([*args.dtypes.split(","), *([args.quant] if args.quant else [])])
    write_json(name, {"shape": args.shape, "rounds": rounds, **settings, "rows": rows, "raw": raw})
    write_report(
        name,
        [
            *report_header(f"{args.shape} against transformers ({rounds} round(s), medians)"),
            title,
            "",
            *markdown_table(rows),
            "",
        ],
    )


if __name__ == "__main__":
    main()
