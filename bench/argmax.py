"""A greedy decode step's argmax: XLA's against the native handler's variants (host_kernels/csrc/xla_argmax.c).

    python bench/argmax.py

Float32 logits of 1 and 16 rows over vocabularies of 4096 (the bench model), 32768 (the real-shape bench models)
and 151936 (Qwen3's), each jitted alone; the best of 7 repeats of 20 calls. Every variant this CPU runs, their
answers checked against XLA's. Writes bench/results/argmax.json.
"""

from __future__ import annotations

import functools
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from moe_jax.native import argmax as native_argmax  # noqa: E402

CASES = ((1, 151936), (16, 4096), (16, 32768), (16, 151936))


def seconds(f, x) -> float:
    f(x).block_until_ready()
    return min(timeit.repeat(lambda: f(x).block_until_ready(), number=20, repeat=7)) / 20


def main():
    variants = [isa for isa in native_argmax.CPU_FLAGS if native_argmax.status(isa)[0]]
    rows = []
    for batch, vocab in CASES:
        x = jax.numpy.asarray(np.random.default_rng(vocab).standard_normal((batch, vocab)).astype(np.float32))
        xla = jax.jit(functools.partial(native_argmax.argmax_tokens, native=False))
        row = {"rows": batch, "vocab": vocab, "xla_us": seconds(xla, x) * 1e6}
        for isa in variants:
            f = jax.jit(functools.partial(native_argmax.argmax_tokens, native=True, isa=isa))
            assert (np.asarray(f(x)) == np.asarray(xla(x))).all(), isa
            row[f"{isa}_us"] = seconds(f, x) * 1e6
            row[f"{isa}_speedup"] = row["xla_us"] / row[f"{isa}_us"]
        rows.append(row)
    print_table("greedy argmax, microseconds a call", rows)
    write_json("argmax", {"rows": rows})


if __name__ == "__main__":
    main()
