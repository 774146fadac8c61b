"""Generation benchmarks, side by side in one run.

    python bench/infer.py [--quick] [--shape bench|qwen3-30b-a3b] [--sides ...]

1. Decode throughput at batch 1 and 16 (32-token prompts, 64 new tokens, no early stop) and prefill of one
   512-token prompt, on a bench model (bench/models.py; --shape): moe_jax with the host backend (float32;
   bfloat16, whose experts and cache attention XLA calls through the FFI handlers; bfloat16 with xla_ffi=False:
   experts through a Python callback; bfloat16 without the fused forward: the engine's numpy path; int8 and int4
   experts) and the device backend (float32), auto (--sides auto_float32,auto_bfloat16; --profile), and Hugging
   Face `generate` on torch CPU in float32 and bfloat16; medians of 3 interleaved rounds; ratios against
   transformers' faster dtype.
2. Agent traces (bench/data/agent_trace.json, bench/agent_traces.py): prompt tokens prefilled with the anchor
   cache and without, for (a) previous thinking dropped each turn and (b) also an old tool result trimmed every
   fourth turn; greedy outputs must be identical with and without the cache.
Writes bench/results/infer.json (infer-SHAPE.json for other shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.agent_traces import ANCHORS, TRACE, requests  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, use_shape  # noqa: E402
from host_kernels import choose_kernels  # noqa: E402
from moe_jax.api import DTYPES  # noqa: E402
from moe_jax.errors import MemoryLimitError  # noqa: E402
from moe_jax.generation.anchor_cache import AnchorCache  # noqa: E402
from moe_jax.generation.engine import GenerationEngine, Request  # noqa: E402

PROMPT, NEW = 32, 64
PREFILL = 512  # the prefill row's prompt length
AUTO_PROFILE = None  # the auto sides' probe profile (--profile); None: this machine's, measured once and cached


def prompts(batch, length=PROMPT):
    rng = np.random.default_rng(batch)
    return [rng.integers(16, 4096, size=length).tolist() for _ in range(batch)]


ROUNDS = 3  # each side runs this many times, interleaved with the others; the table has each side's median


def ours(backend, dtype, batch, new_tokens, prompt=PROMPT, xla_ffi=True, fused=True, quant=None, dense=True):
    """A function that runs one timed generation with moe_jax (compiled, and warmed up, before it is returned).
    `fused=False`: the host experts without the fused native forward (the engine's tiled numpy path);
    `dense=False`: the decode steps' dense products in XLA, whatever the plan chose (for an A/B of that choice)."""
    profile = AUTO_PROFILE if backend == "auto" else None
    kernels = None if fused else dataclasses.replace(choose_kernels(DTYPES[dtype]), fused="")
    model = moe_jax.load_model(
        bench_model_dir(),
        backend=backend,
        dtype=dtype,
        profile=profile,
        xla_ffi=xla_ffi,
        host_kernels=kernels,
        quant=quant,
    )
    if backend == "auto":
        print(f"auto {dtype}, batch {batch}: {model.placement.describe()}")
    if not dense:  # before the first generation, which packs the weights the plan's dense kernel reads
        model.plan = dataclasses.replace(model.plan, dense_decode="")
    return engine_runner(model, batch, new_tokens, prompt)


def engine_runner(model, batch, new_tokens, prompt=PROMPT, temperature=0.0):
    """A function that runs one timed generation of `model` (compiled before it is returned): `batch` prompts of
    `prompt` tokens, `new_tokens` each, greedy or sampled at `temperature` (a random-weight model's greedy tokens
    cycle among a few, whose experts then stay in cache: sampling routes as a real model's text does); with no new
    tokens, a prefill (one token, the prompt's tokens/s)."""
    engine = GenerationEngine(model, batch, prompt + max(new_tokens, 1))
    reqs = [Request(p, max(new_tokens, 1), seed=i) for i, p in enumerate(prompts(batch, prompt))]
    engine.run(reqs, temperature=temperature)  # compiles the steps

    def run():
        engine.stats = type(engine.stats)()
        start = time.perf_counter()
        engine.run(reqs, temperature=temperature)
        total = time.perf_counter() - start
        st = engine.stats
        if not new_tokens:  # a prefill row: the prompt's tokens/s
            return {"prefill_tok_s": st.prefill_tokens / st.prefill_s}
        return {"decode_tok_s": st.decode_tokens / st.decode_s, "end_to_end_tok_s": batch * new_tokens / total}

    return run


def transformers_generate(batch, new_tokens, dtype, device="cpu", prompt=PROMPT):
    """The same for Hugging Face `generate` with torch (greedy, no early stop), on the CPU unless told; with no
    new tokens, one forward over the prompts (a prefill)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(bench_model_dir(), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    ids = torch.tensor(prompts(batch, prompt), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up

    def run():
        with torch.no_grad():
            start = time.perf_counter()
            if not new_tokens:
                model(ids, logits_to_keep=1).logits.cpu()
                return {"prefill_tok_s": batch * prompt / (time.perf_counter() - start)}
            model.generate(ids, **kwargs).cpu()
            return {"end_to_end_tok_s": batch * new_tokens / (time.perf_counter() - start)}

    return run


# side -> (how to make its runner, rounds): the device backend's ragged_dot is slow on XLA:CPU, one round is plenty
SIDES = {
    "transformers_float32": (lambda b, n, p: transformers_generate(b, n, "float32", prompt=p), ROUNDS),
    "transformers_bfloat16": (lambda b, n, p: transformers_generate(b, n, "bfloat16", prompt=p), ROUNDS),
    "host_float32": (lambda b, n, p: ours("host", "float32", b, n, prompt=p), ROUNDS),
    "host_bfloat16": (lambda b, n, p: ours("host", "bfloat16", b, n, prompt=p), ROUNDS),
    "host_int8": (lambda b, n, p: ours("host", "bfloat16", b, n, prompt=p, quant="int8"), ROUNDS),
    "host_int4": (lambda b, n, p: ours("host", "bfloat16", b, n, prompt=p, quant="int4"), ROUNDS),
    "host_bfloat16_callback": (lambda b, n, p: ours("host", "bfloat16", b, n, xla_ffi=False, prompt=p), ROUNDS),
    # the plan's native dense decode products against XLA's, in one run
    "host_float32_xla_dense": (lambda b, n, p: ours("host", "float32", b, n, prompt=p, dense=False), ROUNDS),
    # bfloat16 experts on the engine's numpy path: what a CPU without AMX ran before the AVX512-BF16 kernel
    "host_bfloat16_engine": (lambda b, n, p: ours("host", "bfloat16", b, n, fused=False, prompt=p), ROUNDS),
    "device_float32": (lambda b, n, p: ours("device", "float32", b, n, prompt=p), 1),
    # the planner's placement (a device cache only where the probe profile predicts it pays), --profile to pick one
    "auto_float32": (lambda b, n, p: ours("auto", "float32", b, n, prompt=p), ROUNDS),
    "auto_bfloat16": (lambda b, n, p: ours("auto", "bfloat16", b, n, prompt=p), ROUNDS),
    # for a machine with an accelerator (--sides): everything on it, and experts copied to it per layer
    "device_bfloat16": (lambda b, n, p: ours("device", "bfloat16", b, n, prompt=p), ROUNDS),
    "offload_bfloat16": (lambda b, n, p: ours("offload", "bfloat16", b, n, prompt=p), ROUNDS),
    "transformers_bfloat16_cuda": (lambda b, n, p: transformers_generate(b, n, "bfloat16", "cuda", prompt=p), ROUNDS),
}
CPU_SIDES = [
    "transformers_float32", "transformers_bfloat16", "host_float32", "host_bfloat16", "host_int8", "host_int4",
    "host_bfloat16_callback", "device_float32",
]  # fmt: skip
# the baseline the targets are set against: transformers on the CPU
REFERENCES = ("transformers_float32", "transformers_bfloat16")


def decode_table(cases, sides=CPU_SIDES):
    """Per case (batch, prompt length, new tokens; no new tokens: a prefill), every side's median tokens/s over
    interleaved rounds (A B C A B C ...: a noisy stretch of the machine hits every side alike), and the others
    against transformers' faster CPU dtype."""
    rows = []
    for batch, prompt, new_tokens in cases:
        runners = {name: SIDES[name][0](batch, new_tokens, prompt) for name in sides}
        results: dict[str, list[dict]] = {name: [] for name in sides}
        for round_ in range(ROUNDS):
            for name, run in runners.items():
                if round_ < SIDES[name][1]:
                    results[name].append(run())
        row = {"case": f"prefill {batch} x {prompt}" if not new_tokens else f"decode b{batch}"}
        for name, runs in results.items():
            for key in runs[0]:
                row[f"{name}_{key}"] = float(np.median([r[key] for r in runs]))
        measure = "prefill_tok_s" if not new_tokens else "end_to_end_tok_s"
        references = [row[f"{name}_{measure}"] for name in REFERENCES if name in sides]
        for name in sides:
            if references and name not in REFERENCES:
                row[f"{name}_vs_transformers"] = row[f"{name}_{measure}"] / max(references)
        rows.append(row)
        del runners  # their models, before the next case loads its own (a real shape's two float32 models do not fit)
        gc.collect()
    return rows


def by_side(rows, sides) -> list[dict]:
    """The decode table turned around: one row per side, one column per case (and its ratio to transformers)."""
    table = []
    for name in sides:
        entry = {"side": name}
        for row in rows:
            measure = "prefill_tok_s" if row["case"].startswith("prefill") else "end_to_end_tok_s"
            entry[row["case"]] = row.get(f"{name}_{measure}")
            if f"{name}_vs_transformers" in row:
                entry[f"{row['case']} x"] = row[f"{name}_vs_transformers"]
        table.append(entry)
    return table


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
    parser.add_argument(
        "--sides",
        default=",".join(CPU_SIDES),
        help=f"comma-separated, from: {', '.join(SIDES)} (default: {', '.join(CPU_SIDES)})",
    )
    parser.add_argument("--no-traces", action="store_true", help="the decode table only")
    parser.add_argument(
        "--cases",
        default="b1,batch,prefill",
        help="comma-separated subset of b1 (decode, batch 1), batch (decode, batch 16; 4 with --quick), prefill: "
        "one case per process where a large float32 shape's model does not fit twice (default: all three)",
    )
    parser.add_argument("--profile", type=Path, help="probe profile for the auto sides (default: this machine's)")
    add_shape_argument(parser)
    args = parser.parse_args()
    use_shape(args.shape)
    global AUTO_PROFILE
    AUTO_PROFILE = args.profile
    sides = [name.strip() for name in args.sides.split(",") if name.strip()]
    unknown = [name for name in sides if name not in SIDES]
    if unknown or not sides:
        parser.error(f"unknown side(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SIDES)}")
    new = 16 if args.quick else NEW
    every_case = {"b1": (1, PROMPT, new), "batch": (4 if args.quick else 16, PROMPT, new)}
    every_case["prefill"] = (1, 128 if args.quick else PREFILL, 0)
    chosen = [name.strip() for name in args.cases.split(",") if name.strip()]
    if not chosen or any(name not in every_case for name in chosen):
        parser.error(f"--cases: choose from {', '.join(every_case)}, got {args.cases!r}")
    cases = [every_case[name] for name in chosen]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    decode = decode_table(cases, sides)
    print_table(
        f"tokens/s: decode of {PROMPT}-token prompts, {new} new tokens, end to end (prefill included); prefill; "
        "x: against transformers' faster dtype",
        by_side(decode, sides),
    )
    results = {"jax_device": jax.devices()[0].device_kind, "decode": decode}
    gc.collect()  # the sides' models
    try:
        model = None if args.no_traces else moe_jax.load_model(bench_model_dir(), backend="host")
    except MemoryLimitError as e:  # a large shape in float32 may not fit beside what the process holds
        print(f"agent traces: not run ({e})")
        model = None
    if model is not None:
        traces, detail = trace_table(model, 6 if args.quick else None)
        print_table("agent traces: prompt tokens prefilled with the anchor cache vs without", traces)
        for name, edits in detail.items():
            print_table(f"cost per kind of request, {name}", [{"request": k, **v} for k, v in edits.items()])
        results.update(traces=traces, trace_detail=detail)
    results["shape"] = args.shape
    write_json("infer" if args.shape == "bench" else f"infer-{args.shape}", results)


if __name__ == "__main__":
    main()
