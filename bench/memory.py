"""Host RAM of a generating process against what it must hold, per expert format.

    python bench/memory.py [--shape bench|qwen3-30b-a3b] [--formats bfloat16,int8,int4] [--expert-shards N]

For each format the bench model (bench/models.py) is converted once (`moe_jax.convert`, `--quant` for the
quantized ones, bfloat16 rows) beside it, and a fresh process loads it with the host backend in bfloat16 and
generates (batch 16, 32-token prompts, 64 new tokens). Reported: the expert store's bytes on disk, the dense
weights' (bfloat16, plus the quantized copies a quantized model's decode steps read), the KV cache's, their sum
("expected"), the process's peak RSS (loading included), its RSS once it has generated, and that less its RSS
before loading (Python, jax and the libraries): "model RSS", whose ratio to "expected" is the overhead.

With `--expert-shards N` the model is converted into N shard stores and N processes (`python -m moe_jax.launch`)
each map theirs and generate together (process 0's batch, generation/lockstep.py): a row per process, whose store
is 1/N of the experts. Writes bench/results/memory[-SHAPE][-shardsN].json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import comma_choices, machine_info, print_table, write_json  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402

BATCH, PROMPT, NEW = 16, 32, 64
FORMATS = {"bfloat16": None, "int8": "int8", "int4": "int4"}

CHILD = """
import json, os, resource, sys
import numpy as np
import jax, moe_jax
from moe_jax import distributed
from moe_jax.distributed import this_process_shard
from moe_jax.generation import lockstep
from moe_jax.generation.engine import GenerationEngine, Request
path, batch, prompt, new, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
world = distributed.join()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = moe_jax.load_model(path, backend="host", dtype="bfloat16", expert_shard=this_process_shard(world.count))
rng = np.random.default_rng(0)
requests = [Request(rng.integers(16, 4096, size=prompt).tolist(), new) for _ in range(batch)]
lockstep.run(model, lambda: GenerationEngine(model, batch, prompt + new).run(requests))
dense = sum(leaf.nbytes for leaf in jax.tree.leaves(model.state) if hasattr(leaf, "nbytes"))
kv = batch * model.kv.bytes_per_sequence(prompt + new)  # every process holds the whole batch's KV cache
store = model.placement.runtime.compute.store.nbytes
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
now = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
mine = {"before": before, "peak": peak, "now": now, "dense": dense, "kv": kv, "store": store}
every = distributed.gather_objects([mine])
if world.is_main:
    open(out, "w").write(json.dumps([figures for (figures,) in every]))
"""


def converted(fmt: str, shards: int = 1) -> Path:
    """The bench model converted with this format's experts, in `shards` stores (made once, beside the
    checkpoint)."""
    source = bench_model_dir()
    out = source.with_name(f"{source.name}_converted_{fmt}" + (f"_shards{shards}" if shards > 1 else ""))
    store = "experts" if shards == 1 else f"experts.shard-0-of-{shards}"
    if not (out / store / "manifest.json").exists():
        quant = ["--quant", FORMATS[fmt]] if FORMATS[fmt] else []
        cmd = [sys.executable, "-m", "moe_jax.convert", "--hf", str(source), "--out", str(out), "--overwrite"]
        subprocess.run([*cmd, "--dtype", "bfloat16", *quant, "--expert-shards", str(shards)], check=True)
    return out


def measure(fmt: str, shards: int = 1) -> list[dict]:
    path = converted(fmt, shards)
    launcher = ["-m", "moe_jax.launch", "-n", str(shards)] if shards > 1 else []
    with tempfile.TemporaryDirectory(prefix="moe_jax_bench_memory_") as scratch:
        child, out = Path(scratch) / "child.py", Path(scratch) / "figures.json"
        child.write_text(CHILD)
        subprocess.run(
            [sys.executable, *launcher, str(child), str(path), str(BATCH), str(PROMPT), str(NEW), str(out)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        figures = json.loads(out.read_text())
    return [_row(fmt, process, child) for process, child in enumerate(figures)]


def _row(fmt: str, process: int, child: dict) -> dict:
    store = child["store"]
    expected = store + child["dense"] + child["kv"]
    model_rss = child["now"] - child["before"]
    gib = 2**30
    return {
        "experts": fmt,
        "process": process,
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
    parser.add_argument("--expert-shards", type=int, default=1, help="N processes, each 1/N of the experts")
    add_shape_argument(parser)
    args = parser.parse_args()
    use_shape(args.shape)
    formats = comma_choices(parser, args.formats, FORMATS, "--formats")
    print(machine_info())
    rows = [row for fmt in formats for row in measure(fmt, args.expert_shards)]
    print_table(f"host RAM, shape {args.shape}: batch {BATCH}, {PROMPT} + {NEW} tokens", rows)
    name = "memory" if args.shape == "bench" else f"memory-{args.shape}"
    name += f"-shards{args.expert_shards}" if args.expert_shards > 1 else ""
    payload = {"shape": args.shape, "batch": BATCH, "prompt": PROMPT, "new": NEW, "shards": args.expert_shards}
    write_json(name, {**payload, "rows": rows})


if __name__ == "__main__":
    main()
