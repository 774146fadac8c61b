"""Two checkouts of moe_jax side by side: is a change as fast as the commit it started from?

    python bench/ab_checkouts.py --base /path/to/other/checkout [--shapes bench,qwen3-30b-a3b] [--rounds 3]

Each round runs one fresh process per checkout, A B then B A in the next round, each process importing moe_jax from its
own checkout (with its own native library: build it there first, `python setup.py build_ext --inplace`). A process loads
the bench model (bench/models.py, per --shapes) with the host backend in its shape's dtype and measures greedy decode at
batch 1 and 16 (32-token prompts, 64 new tokens: the engine's decode tokens/s), the prefill of one 512-token prompt
(tokens/s), and a LoRA training step (bench/train.py's `run_moe_jax`: r=8 on the attention, batch 2 x 128 tokens, the
median of 3 steps after 2 warm-up ones). Reported per shape and measurement: each checkout's median over the rounds and
the median of the per-round ratios this / base. Writes bench/reports/ab_checkouts.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PROMPT, NEW, PREFILL = 32, 64, 512
TRAIN_BATCH, TRAIN_SEQ, TRAIN_STEPS = 2, 128, 3
# higher is better for every figure but the training step's seconds
MEASURES = ("decode_b1_tok_s", "decode_b16_tok_s", "prefill_tok_s", "train_step_s")


def child(checkout: Path, shape: str) -> dict:
    """One process's figures, measured with the moe_jax of `checkout`."""
    sys.path.insert(0, str(checkout))
    import numpy as np

    import moe_jax
    from bench.models import bench_model_dir, use_shape
    from bench.train import run_moe_jax
    from moe_jax.generation.engine import GenerationEngine, Request

    assert Path(moe_jax.__file__).resolve().is_relative_to(checkout.resolve()), moe_jax.__file__
    use_shape(shape)
    dtype = "float32" if shape == "bench" else "bfloat16"
    model = moe_jax.load_model(bench_model_dir(), backend="host", dtype=dtype)
    rng = np.random.default_rng(0)
    out = {}

    def generation(batch: int, prompt: int, new: int) -> dict:
        engine = GenerationEngine(model, batch, prompt + new)
        requests = [Request(rng.integers(16, 4096, size=prompt).tolist(), new, seed=i) for i in range(batch)]
        engine.run(requests)  # compiles
        engine.stats = type(engine.stats)()
        engine.run(requests)
        return engine.stats

    for batch in (1, 16):
        st = generation(batch, PROMPT, NEW)
        out[f"decode_b{batch}_tok_s"] = st.decode_tokens / st.decode_s
    st = generation(1, PREFILL, 1)
    out["prefill_tok_s"] = st.prefill_tokens / st.prefill_s

    # the training step loads its own model, as bench/train.py's moe_jax sides do
    times, _, _ = run_moe_jax("host", dtype, TRAIN_BATCH, TRAIN_SEQ, TRAIN_STEPS)
    out["train_step_s"] = statistics.median(times)
    return out


def run_child(checkout: Path, shape: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, __file__, "--child", str(checkout), "--shape", shape]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=checkout)
    if done.returncode:
        raise SystemExit(f"{checkout} ({shape}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the other checkout (its native library built)")
    parser.add_argument("--shapes", default="bench,qwen3-30b-a3b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.shape)))
        return
    if args.base is None or not (args.base / "moe_jax").is_dir():
        parser.error("--base must name a moe_jax checkout")
    sys.path.insert(0, str(HERE))
    from bench.common import markdown_table, report_header, write_report

    sides = {"this": HERE, "base": args.base}
    lines = report_header("This checkout against another, A B / B A in separate processes")
    base_commit = subprocess.run(["git", "-C", str(args.base), "rev-parse", "--short", "HEAD"], capture_output=True)
    lines += [f"Base: `{base_commit.stdout.decode().strip()}` ({args.base}); {args.rounds} rounds.", ""]
    for shape in args.shapes.split(","):
        results = {"this": [], "base": []}
        for r in range(args.rounds):
            for name in ("this", "base") if r % 2 == 0 else ("base", "this"):
                results[name].append(run_child(sides[name], shape))
                print(shape, r, name, results[name][-1], flush=True)
        rows = []
        for m in MEASURES:
            ratios = [t[m] / b[m] for t, b in zip(results["this"], results["base"], strict=True)]
            rows.append(
                {
                    "measure": m,
                    "this": statistics.median(x[m] for x in results["this"]),
                    "base": statistics.median(x[m] for x in results["base"]),
                    "this / base (median of rounds)": statistics.median(ratios),
                    "range": f"{min(ratios):.3f}-{max(ratios):.3f}",
                }
            )
        lines += [f"## {shape}", "", *markdown_table(rows), ""]
        print("\n".join(markdown_table(rows)), flush=True)
    print(write_report("ab_checkouts", lines))


if __name__ == "__main__":
    main()
