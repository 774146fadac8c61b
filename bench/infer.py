"""Generation benchmarks, side by side in one run.

    python bench/infer.py [--quick]

1. Decode throughput at batch 1 and 16 (32-token prompts, 64 new tokens, no early stop) on the Mixtral-shaped
   bench model: moe_jax with the host backend (float32 and bfloat16) and the device backend (float32), and
   Hugging Face `generate` on torch CPU in float32 and bfloat16; ratios are against transformers' faster dtype.
2. Agent traces (bench/data/agent_trace.json, bench/agent_traces.py): prompt tokens prefilled with the anchor
   cache and without, for (a) previous thinking dropped each turn and (b) also an old tool result trimmed every
   fourth turn; greedy outputs must be identical with and without the cache.
Writes bench/results/infer.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.agent_traces import ANCHORS, TRACE, requests  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402
from bench.models import bench_model_dir  # noqa: E402
from moe_jax.anchor_cache import AnchorCache  # noqa: E402
from moe_jax.engine import GenerationEngine, Request  # noqa: E402

PROMPT, NEW = 32, 64


def prompts(batch):
    rng = np.random.default_rng(batch)
    return [rng.integers(16, 4096, size=PROMPT).tolist() for _ in range(batch)]


def ours(model, batch, new_tokens):
    engine = GenerationEngine(model, batch, PROMPT + new_tokens)
    reqs = [Request(p, new_tokens) for p in prompts(batch)]
    engine.run(reqs)  # compiles
    engine.stats = type(engine.stats)()
    start = time.perf_counter()
    engine.run(reqs)
    total = time.perf_counter() - start
    st = engine.stats
    return {"decode_tok_s": st.decode_tokens / st.decode_s, "end_to_end_tok_s": batch * new_tokens / total}


def transformers_generate(batch, new_tokens, dtype="float32"):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(bench_model_dir(), dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts(batch))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        total = time.perf_counter() - start
    return {"end_to_end_tok_s": batch * new_tokens / total}


def decode_table(batches, new_tokens):
    rows = []
    for batch in batches:
        row = {"batch": batch}
        for dtype in ("float32", "bfloat16"):
            row[f"transformers_{dtype}_tok_s"] = transformers_generate(batch, new_tokens, dtype)["end_to_end_tok_s"]
        reference = max(row["transformers_float32_tok_s"], row["transformers_bfloat16_tok_s"])
        for backend, dtype in (("host", "float32"), ("host", "bfloat16"), ("device", "float32")):
            result = ours(moe_jax.load_model(bench_model_dir(), backend=backend, dtype=dtype), batch, new_tokens)
            name = f"{backend}_{dtype}"
            row[f"{name}_decode_tok_s"] = result["decode_tok_s"]
            row[f"{name}_end_to_end_tok_s"] = result["end_to_end_tok_s"]
            row[f"{name}_vs_transformers"] = result["end_to_end_tok_s"] / reference
        rows.append(row)
    return rows


def trace_table(model, turns=None):
    trace = json.loads(TRACE.read_text())
    if turns:
        trace["turns"] = trace["turns"][:turns]
    rows, detail = [], {}
    for name, trim in (("a: thinking dropped", False), ("b: + old tool results trimmed", True)):
        reqs = requests(trace, trim)
        cache = AnchorCache(ANCHORS, budget_bytes=256 << 20)
        with_cache, without = [], []
        per_edit: dict[str, list[int]] = {}
        longest = max(len(p) for _, p in reqs)
        cached_engine = GenerationEngine(model, 1, longest + 4, cache)
        plain_engine = GenerationEngine(model, 1, longest + 4)
        start = time.perf_counter()
        for edit, prompt in reqs:
            before = cache.stats.prefilled_tokens
            with_cache.append(cached_engine.run([Request(prompt, 4)])[0].tokens)
            per_edit.setdefault(edit, []).append(cache.stats.prefilled_tokens - before)
        cached_s = time.perf_counter() - start
        start = time.perf_counter()
        for _, prompt in reqs:
            without.append(plain_engine.run([Request(prompt, 4)])[0].tokens)
        plain_s = time.perf_counter() - start
        s = cache.summary()
        rows.append(
            {
                "scenario": name,
                "requests": len(reqs),
                "prompt_tokens": s["prompt_tokens"],
                "prefilled_with_cache": s["prefilled_tokens"],
                "fewer_prefilled": 1 - s["prefilled_tokens"] / s["prompt_tokens"],
                "identical_outputs": with_cache == without,
                "seconds_with_cache": cached_s,
                "seconds_without": plain_s,
                "cache_MiB": s["bytes_held"] / 2**20,
            }
        )
        detail[name] = {edit: {"requests": len(v), "mean_prefilled": float(np.mean(v))} for edit, v in per_edit.items()}
    return rows, detail


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, 16 new tokens, 6 turns")
    args = parser.parse_args()
    batches, new = ([1, 4], 16) if args.quick else ([1, 16], NEW)
    decode = decode_table(batches, new)
    print_table(f"decode: {PROMPT}-token prompts, {new} new tokens (end to end includes prefill)", decode)
    traces, detail = trace_table(moe_jax.load_model(bench_model_dir(), backend="host"), 6 if args.quick else None)
    print_table("agent traces: prompt tokens prefilled with the anchor cache vs without", traces)
    for name, edits in detail.items():
        print_table(f"cost per kind of request, {name}", [{"request": k, **v} for k, v in edits.items()])
    write_json("infer", {"decode": decode, "traces": traces, "trace_detail": detail})


if __name__ == "__main__":
    main()
