"""Host RAM of a generating process against what it must hold, per expert format.

    python bench/memory.py [--shape bench|qwen3-30b-a3b] [--formats bfloat16,int8,int4]

For each format the bench model (bench/models.py) is converted once (`moe_jax.convert`, `--quant` for the
quantized ones, bfloat16 rows) beside it, and a fresh process loads it with the host backend in bfloat16 and
generates (batch 16, 32-token prompts, 64 new tokens). Reported: the expert store's bytes on disk, the dense
weights' (bfloat16, plus the quantized copies a quantized model's decode steps read), the KV cache's, their sum
("expected"), the process's peak RSS (loading included), its RSS once it has generated, and that less its RSS
before loading (Python, jax and the libraries): "model RSS", whose ratio to "expected" is the overhead. Writes
bench/results/memory[-SHAPE].json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import comma_choices, machine_info, print_table, write_json  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402

BATCH, PROMPT, NEW = 16, 32, 64
FORMATS = {"bfloat16": None, "int8": "int8", "int4": "int4"}

CHILD = """
import json, resource, sys
import numpy as np
import jax, moe_jax
from moe_jax.generation.engine import GenerationEngine, Request
path, batch, prompt, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = moe_jax.load_model(path, backend="host", dtype="bfloat16")
engine = GenerationEngine(model, batch, prompt + new)
rng = np.random.default_rng(0)
engine.run([Request(rng.integers(16, 4096, size=prompt).tolist(), new) for _ in range(batch)])
dense = sum(leaf.nbytes for leaf in jax.tree.leaves(model.state) if hasattr(leaf, "nbytes"))
kv = sum(leaf.nbytes for leaf in jax.tree.leaves(model.kv.new_caches(batch, prompt + new)))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
import os
now = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print(json.dumps({"before": before, "peak": peak, "now": now, "dense": dense, "kv": kv}))
"""


def converted(fmt: str) -> Path:
    """The bench model converted with this format's experts (made once, beside the checkpoint)."""
    source = bench_model_dir()
    out = source.with_name(f"{source.name}_converted_{fmt}")
    if not (out / "experts" / "manifest.json").exists():
        quant = ["--quant", FORMATS[fmt]] if FORMATS[fmt] else []
        cmd = [sys.executable, "-m", "moe_jax.convert", "--hf", str(source), "--out", str(out), "--overwrite"]
        subprocess.run([*cmd, "--dtype", "bfloat16", *quant], check=True)
    return out


def measure(fmt: str) -> dict:
    path = converted(fmt)
    store = sum(f.stat().st_size for f in (path / "experts").glob("*.bin"))
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(BATCH), str(PROMPT), str(NEW)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    child = json.loads(run.stdout.strip().splitlines()[-1])
    expected = store + child["dense"] + child["kv"]
    model_rss = child["now"] - child["before"]
    gib = 2**30
    return {
        "experts": fmt,
        "store GiB": store / gib,
        "dense GiB": child["dense"] / gib,
        "KV GiB": child["kv"] / gib,
        "expected GiB": expected / gib,
        "peak RSS GiB": child["peak"] / gib,
        "RSS after GiB": child["now"] / gib,
        "model RSS GiB": model_rss / gib,
        "model RSS / expected": model_rss / expected,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)}")
    add_shape_argument(parser)
    args = parser.parse_args()
    use_shape(args.shape)
    formats = comma_choices(parser, args.formats, FORMATS, "--formats")
    print(machine_info())
    rows = [measure(fmt) for fmt in formats]
    print_table(f"host RAM, shape {args.shape}: batch {BATCH}, {PROMPT} + {NEW} tokens", rows)
    name = "memory" if args.shape == "bench" else f"memory-{args.shape}"
    write_json(name, {"shape": args.shape, "batch": BATCH, "prompt": PROMPT, "new": NEW, "rows": rows})


if __name__ == "__main__":
    main()
