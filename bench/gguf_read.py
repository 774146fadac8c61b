"""GGUF files on a bench model: how long reading llama.cpp's format takes, by path, beside loading a converted
directory, and the decode speed of what each path gives.

    python bench/gguf_read.py [--shape bench|qwen3-30b-a3b] [--tokens 32]

The shape's checkpoint (bench/models.py) is written as GGUF files the way llama.cpp's converter lays them out
(tests/gguf_files.py): Q4_0 experts with Q8_0 dense weights (llama.cpp's plain 4-bit file), and Q8_0 throughout.
Timed once each (they are minutes on the real shape): `convert --gguf` of the Q4_0 file (experts repacked to int4
value for value), of the Q8_0 file (requantized to int8 through float), `load_model` of the Q4_0 file with
quant="int4" (the same repack), `load_model` of the Q8_0 file as bfloat16 (every expert dequantized), and of the
converted directory; then greedy decode tokens/s at batch 1 of the int4 model loaded both ways (the same weights:
their logits are compared; medians of 3 interleaved rounds). Writes bench/results/gguf[-SHAPE].json.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402
from bench.infer import engine_runner  # noqa: E402
from bench.models import SHAPES, add_shape_argument, bench_model_dir, use_shape  # noqa: E402
from moe_jax.convert import convert  # noqa: E402
from tests.gguf_files import write_gguf  # noqa: E402


def gguf_files(shape: str, directory: Path) -> dict[str, Path]:
    """The shape's checkpoint as GGUF files: {"q4_0": Q4_0 experts and Q8_0 dense weights, "q8_0": all Q8_0}."""
    import torch
    import transformers

    _, model_class, _, _ = SHAPES[shape]
    model = getattr(transformers, model_class).from_pretrained(bench_model_dir(), dtype=torch.float32).eval()
    return {
        "q4_0": write_gguf(model, directory / "q4_0.gguf", dense="Q8_0", experts="Q4_0"),
        "q8_0": write_gguf(model, directory / "q8_0.gguf", dense="Q8_0"),
    }


def seconds(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(parser)
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens timed per model")
    args = parser.parse_args()
    use_shape(args.shape)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files, write_s = seconds(lambda: gguf_files(args.shape, tmp))
        layers = moe_jax.load_model(files["q4_0"], quant="int4", dtype="bfloat16").config.moe_layers
        rows = []

        def timed(name, fn):
            result, elapsed = seconds(fn)
            rows.append({"path": name, "seconds": elapsed, "per MoE layer": elapsed / len(layers)})
            return result

        timed("convert --gguf (Q4_0 -> int4 repack)", lambda: convert(files["q4_0"], tmp / "int4", progress=False))
        timed("convert --gguf (Q8_0 -> int8 requantized)", lambda: convert(files["q8_0"], tmp / "int8", progress=False))
        at_load = timed(
            "load_model(Q4_0 file, quant=int4)",
            lambda: moe_jax.load_model(files["q4_0"], quant="int4", dtype="bfloat16"),
        )
        timed("load_model(Q8_0 file, bfloat16 experts)", lambda: moe_jax.load_model(files["q8_0"], dtype="bfloat16"))
        converted = timed(
            "load_model(converted int4 directory)", lambda: moe_jax.load_model(tmp / "int4", dtype="bfloat16")
        )
        ids = np.arange(1, 33)[None]
        same = float(np.abs(at_load.logits(ids) - converted.logits(ids)).max())
        runners = {
            "decode b1 tok/s, Q4_0 file loaded": engine_runner(at_load, 1, args.tokens),
            "decode b1 tok/s, converted directory": engine_runner(converted, 1, args.tokens),
        }
        rounds = {name: [] for name in runners}
        for _ in range(3):  # A B A B: the machine's drift falls on both
            for name, run in runners.items():
                rounds[name].append(run()["decode_tok_s"])
        speed = {name: sorted(values)[1] for name, values in rounds.items()}
        sizes = {name: path.stat().st_size / 2**30 for name, path in files.items()}
        shutil.rmtree(tmp / "int4")
    print_table(f"GGUF on shape {args.shape} ({len(layers)} MoE layers; files written in {write_s:.0f} s)", rows)
    print(f"int4 logits, file vs converted directory: max |diff| {same}")
    print("  ".join(f"{k}: {v:.1f}" for k, v in speed.items()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    write_json(
        "gguf" if args.shape == "bench" else f"gguf-{args.shape}",
        {
            "shape": args.shape,
            "file_gib": sizes,
            "rows": rows,
            "logits_max_abs_diff": same,
            **speed,
            "peak_rss_gib": peak,
        },
    )


if __name__ == "__main__":
    main()
