"""How close batch-1 decode comes to its memory bound: a step's time against the time its bytes take to read.

    python bench/decode_bound.py [--shape bench|qwen3-30b-a3b] [--formats float32,bfloat16,int8,int4] [--rounds 5]

At batch 1 a decode step reads every dense weight once (attention, routers, head: the packed copies that the
native products read), the top-k routed experts of each MoE layer, and the KV cache up to its position; no engine
can take less time than those bytes take to come from memory. Per format this loads the bench model
(bench/models.py), counts a step's bytes, and alternates `--rounds` times a timed greedy generation (32-token
prompt, 64 new tokens) with the machine's weight-streaming rate (bench/common.py's GEMVs: each thread over its share
of 256 MB of float32 matrices). The machine's memory speed moves from minute to minute, so each round's step is set
against the rate measured beside it; reported are medians over rounds of the bytes a step reads, the rate, the step,
and step / (bytes / rate): 1.0 is a step that does nothing but read its weights at the rate plain GEMVs reach.
Below 1 means the reference is loose, not that the step beat memory: the GEMVs read at ~0.85-0.93 of a plain
two-thread AVX-512 read on a Zen 5, and a small model's weights partly stay in the last-level cache from one step to
the next (the bench model in int4 is ~42 MB in all, against a 32 MB L3 there). On real shapes (--shape
qwen3-30b-a3b: 103-362 MB a step) nothing stays cached, and a ratio well above 1 says where a format leaves time.
Writes bench/results/decode_bound[-SHAPE].json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import moe_jax  # noqa: E402
from bench.common import comma_choices, gemv_streaming, machine_info, print_table, write_json  # noqa: E402
from bench.infer import NEW, PROMPT, engine_runner  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402
from host_kernels import default_threads  # noqa: E402
from host_kernels.quant_formats import FORMATS as QUANT_FORMATS  # noqa: E402

FORMATS = {  # name -> load_model settings, as bench/infer.py names them
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quant": "int8"},
    "int4": {"dtype": "bfloat16", "quant": "int4"},
}
PACKED = ("packed", "qkv_packed", "router_packed", "head_packed")  # the modules' copies for native decode products
STREAM_BYTES = 256 << 20  # larger than any cache here: the rate of weights that come from DRAM


def dense_bytes(model) -> int:
    """Bytes of the packed dense weights a decode step's native products read (all of them, once a step)."""
    total = 0
    for _, module in nnx.iter_modules(model.transformer):
        for name in PACKED:
            value = getattr(module, name, None)
            if isinstance(value, nnx.Variable):
                total += value[...].nbytes
    return total


def expert_bytes(config, settings) -> int:
    """Bytes of one expert's weights as the host store holds them (w13 and w2, packed, scales included)."""
    d, f = config.hidden_size, config.expert_intermediate_size
    quant = settings.get("quant")
    if quant:
        fmt = QUANT_FORMATS[quant]
        return math.prod(fmt.packed_shape(d, 2 * f)) + math.prod(fmt.packed_shape(f, d))
    return 3 * d * f * (4 if settings["dtype"] == "float32" else 2)


def step_bytes(model, settings) -> dict:
    """What one batch-1 decode step reads, by part (the KV cache at the generation's middle position)."""
    config = model.config
    moe_layers = config.num_layers - len(config.dense_layers)
    caches = jax.tree.leaves(model.kv.new_caches(1, PROMPT + NEW))
    kv = sum(c.nbytes for c in caches) * (PROMPT + NEW / 2) / (PROMPT + NEW)
    return {
        "dense": dense_bytes(model),
        "experts": moe_layers * config.num_experts_per_tok * expert_bytes(config, settings),
        "kv": int(kv),
    }


def measure(name: str, settings: dict, rounds: int, threads: int, read_gbps) -> dict:
    model = moe_jax.load_model(bench_model_dir(), backend="host", host_threads=threads, **settings)
    run = engine_runner(model, 1, NEW)  # compiles, and packs the dense weights for the native products
    if not model.plan.dense_decode:
        raise SystemExit(f"{name}: this machine's plan multiplies dense weights in XLA; the count needs packed ones")
    parts = step_bytes(model, settings)
    total = sum(parts.values())
    steps, rates, ratios = [], [], []
    for _ in range(rounds):
        step = 1 / run()["decode_tok_s"]
        rate = read_gbps(repeats=3) * 1e9
        steps.append(step)
        rates.append(rate)
        ratios.append(step / (total / rate))
    return {
        "format": name,
        "MB a step": total / 1e6,
        **{f"{part} MB": b / 1e6 for part, b in parts.items()},
        "read GB/s": statistics.median(rates) / 1e9,
        "step us": statistics.median(steps) * 1e6,
        "step / bound": statistics.median(ratios),
        "rounds": [round(r, 3) for r in ratios],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=default_threads())
    add_shape_argument(parser)
    args = parser.parse_args()
    use_shape(args.shape)
    names = comma_choices(parser, args.formats, FORMATS, "--formats")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    print(machine_info())
    read_gbps = gemv_streaming(np.random.default_rng(0), STREAM_BYTES, args.threads)
    rows = [measure(name, FORMATS[name], args.rounds, args.threads, read_gbps) for name in names]
    print_table(f"decode batch 1 against reading its bytes once, {args.threads} threads, shape {args.shape}",
                [{k: v for k, v in r.items() if k != "rounds"} for r in rows])  # fmt: skip
    name = "decode_bound" if args.shape == "bench" else f"decode_bound-{args.shape}"
    write_json(name, {"shape": args.shape, "threads": args.threads, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
