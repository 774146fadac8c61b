"""Speculative decoding with prompt-lookup drafts: what it gains where outputs copy their context, what it costs
where they do not, and what a wider step costs on real layer dims.

    python bench/speculative.py [--rounds 5] [--shape qwen3-30b-a3b] [--quants bf16,int4] [--skip-cost]

1. The bundled model on workloads of its own: `tool calls` (agent-like: offered a made-up tool, it calls it on the
   user's last word, a ~58-token JSON call whose name, parameter and argument it copies from the prompt and whose
   syntax it repeats from its earlier calls; greedy, and sampled at temperature 0.7), `copy` prompts (the answer
   repeats the prompt's word: a few tokens) and `sort` / `reverse` ones (permutations: drafts mostly rejected).
   Decode tokens/s without drafts, with up to 7 as the cost policy chooses (the default) and with the widest step
   at every call, at batch 1 and 16, the sides interleaved over the rounds, medians and the lowest round's ratio;
   greedy outputs must be identical. Random-weight models never copy their context, so acceptance is measured here.
2. The cost side on a shape's real layer dims (default Qwen3-30B-A3B, 2 layers): one verify step's seconds at 1, 2,
   4 and 8 tokens a row for 1 and 16 rows, random tokens (uniform routing: the most experts a wider step can add),
   medians; the ratio to one token a row and the acceptance rate at which each width starts to pay (where
   1 + a + ... + a^(w-1) equals the step's cost ratio), and the speedup each width would give at the acceptance
   the tool-call workload measured.
Writes bench/reports/speculative.md and bench/results/speculative.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.common import comma_choices, markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from bench.models import bench_model_dir, use_shape  # noqa: E402
from bench.vs_llamacpp import PAIRS  # noqa: E402
from moe_jax import bundled  # noqa: E402
from moe_jax.data.tasks import prompt, random_word, tool_task  # noqa: E402
from moe_jax.formats.prompts import render_chat  # noqa: E402
from moe_jax.generation.engine import GenerationEngine, Request  # noqa: E402

DRAFTS = 7
PROMPTS = 512  # per workload: runs of a second or more (this machine moves a 0.1 s run by up to 1.5x either way)
TASK_TOKENS = 16  # at most, for copy / sort / reverse: their answers end at EOS after a word
CONTEXT = 128  # the bundled model's context: a tool call may run to its end
COST_WIDTHS = (1, 2, 4, 8)
COST_ROWS = (1, 16)
COST_CONTEXT, COST_POSITION, COST_CALLS = 512, 256, 15


def task_requests(model, tasks, seed: int) -> list[Request]:
    rng = random.Random(seed)
    texts = [prompt(tasks[i % len(tasks)], random_word(rng)) for i in range(PROMPTS)]
    return [Request(model.tokenizer.encode(t), TASK_TOKENS) for t in texts]


def tool_call_requests(model, seed: int) -> list[Request]:
    """Single-turn tool calls: each prompt offers one made-up tool (moe_jax.data.tasks.tool_task)."""
    rng, requests = random.Random(seed), []
    for _ in range(PROMPTS):
        tool, message, _ = tool_task(rng)
        text = render_chat(model.tokenizer, [{"role": "user", "content": message}], tools=[tool])
        tokens = model.tokenizer.encode(text, add_special_tokens=False)  # (the template writes <s>)
        requests.append(Request(tokens, CONTEXT - len(tokens)))
    return requests


SAMPLED = "tool calls, sampled"  # at SAMPLED_TEMPERATURE: drafts kept by speculative sampling, on the host
SAMPLED_TEMPERATURE = 0.7
WORKLOADS = {
    "tool calls": tool_call_requests,
    SAMPLED: tool_call_requests,
    "copy": lambda model, seed: task_requests(model, ("copy",), seed),
    "sort / reverse": lambda model, seed: task_requests(model, ("sort", "reverse"), seed),
}
SIDES = ("plain", "cost", "always")  # no drafts; --draft-tokens DRAFTS as the cost policy decides; the widest always


def decode_run(model, requests, batch: int, side: str, temperature: float = 0.0) -> dict:
    drafts = 0 if side == "plain" else DRAFTS
    engine = GenerationEngine(model, batch, CONTEXT, drafts=drafts, draft_policy="cost" if side == "plain" else side)
    completions = engine.run(requests, temperature, eos_ids=model.config.eos_token_ids)
    st = engine.stats
    return {
        "tokens": [c.tokens for c in completions],
        "tok_s": st.decode_tokens / st.decode_s,
        "acceptance": st.acceptance,
        "tokens_per_step": st.decode_tokens / max(st.decode_steps, 1) / min(batch, len(requests)),
        "new_tokens": st.decode_tokens / len(requests),
    }


def bundled_rows(rounds: int) -> list[dict]:
    model = moe_jax.load_model(bundled.MODEL)
    rows = []
    for seed, (kind, make) in enumerate(WORKLOADS.items()):
        requests, temperature = make(model, seed), SAMPLED_TEMPERATURE if kind == SAMPLED else 0.0
        for batch in (1, 16):
            for side in SIDES:  # compiles every step each side takes
                decode_run(model, requests, batch, side, temperature)
            runs = {side: [] for side in SIDES}
            for i in range(rounds):
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    runs[side].append(decode_run(model, requests, batch, side, temperature))
            plain = runs["plain"]
            # (sampled: the same seeds, other draws where drafts were offered; tests/test_speculative.py checks
            # their distribution)
            greedy_runs = [] if temperature else [run for side in SIDES for run in runs[side]]
            if any(run["tokens"] != plain[0]["tokens"] for run in greedy_runs):
                raise AssertionError(f"{kind}, batch {batch}: speculative outputs differ from plain decoding")
            row = {
                "workload": kind,
                "batch": batch,
                "new_tokens": statistics.median(r["new_tokens"] for r in plain),
                "plain_tok_s": statistics.median(r["tok_s"] for r in plain),
            }
            for side in SIDES[1:]:
                ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(plain, runs[side], strict=True)]
                row[f"{side}_ratio"] = statistics.median(ratios)
                row[f"{side}_lowest"] = min(ratios)
            always = runs["always"]
            row["acceptance"] = statistics.median(r["acceptance"] for r in always)  # drafts verified whatever the cost
            # tokens a row's step yields with the widest steps: what the real dims' table weighs against their cost
            row["always_tokens_per_step"] = statistics.median(r["tokens_per_step"] for r in always)
            rows.append(row)
    return rows


def tokens_per_step() -> dict[int, float]:
    """Tokens a row's step yields on the tool-call workload at batch 1 with every step `width` wide (width - 1
    drafts), by width: the gain side of a real shape's cost table."""
    model = moe_jax.load_model(bundled.MODEL)
    requests = tool_call_requests(model, 0)
    out = {1: 1.0}
    for width in COST_WIDTHS[1:]:
        engine = GenerationEngine(model, 1, CONTEXT, drafts=width - 1, draft_policy="always")
        engine.run(requests[: PROMPTS // 4], eos_ids=model.config.eos_token_ids)
        out[width] = engine.stats.decode_tokens / engine.stats.decode_steps
    return out


def verify_seconds(model, rows: int) -> dict[int, float]:
    """By width: the median seconds of one verify step of that many random tokens for each of `rows` rows, the
    widths taking turns call by call (a slow stretch of the machine then slows each of them alike)."""
    rng = np.random.default_rng(rows)
    engine = GenerationEngine(model, rows, COST_CONTEXT)
    times = {width: [] for width in COST_WIDTHS}
    with engine.batch(rows) as batch:
        for i in range(COST_CALLS + 1):  # the first of each width compiles
            for width in COST_WIDTHS:
                positions = np.broadcast_to(COST_POSITION + np.arange(width, dtype=np.int32), (rows, width))
                tokens = rng.integers(0, model.config.vocab_size, (rows, width), dtype=np.int32)
                start = time.perf_counter()
                logits, batch.caches = engine.verify(batch.caches, tokens, positions)
                jax.block_until_ready(logits)  # (on the device: the speculative block takes their argmax there)
                if i:
                    times[width].append(time.perf_counter() - start)
    return {width: statistics.median(t) for width, t in times.items()}


def break_even(cost_ratio: float, width: int) -> float:
    """The acceptance rate a at which 1 + a + ... + a^(width - 1) tokens a step equal the step's cost ratio."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(width)) < cost_ratio else (lo, a)
    return (lo + hi) / 2


def cost_rows(shape: str, quants: list[str], gains: dict[int, float]) -> list[dict]:
    use_shape(shape)
    rows = []
    for quant in quants:
        model = moe_jax.load_model(bench_model_dir(), backend="host", **PAIRS[quant].settings)
        for n in COST_ROWS:
            by_width = verify_seconds(model, n)
            for width, seconds in by_width.items():
                ratio = seconds / by_width[1]
                rows.append(
                    {
                        "quant": quant,
                        "rows": n,
                        "tokens_a_row": width,
                        "step_ms": seconds * 1e3,
                        "cost_ratio": ratio,
                        "pays_above_acceptance": break_even(ratio, width) if width > 1 else None,
                        "tool_call_speedup": gains[width] / ratio,
                    }
                )
        del model
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="the cost table's shape (bench/models.py)")
    parser.add_argument("--quants", default="bf16,int4", help="the cost table's formats, from " + ", ".join(PAIRS))
    parser.add_argument("--skip-cost", action="store_true", help="only the bundled model's table")
    args = parser.parse_args()
    quants = comma_choices(parser, args.quants, [p for p in PAIRS if p != "mxfp4"], "--quants")
    end_to_end = bundled_rows(args.rounds)
    print_table(f"bundled model, greedy decode tok/s without drafts; ratios with up to {DRAFTS}", end_to_end)
    gains = tokens_per_step()
    costs = [] if args.skip_cost else cost_rows(args.shape, quants, gains)
    if costs:
        print_table(f"{args.shape}: one verify step by tokens a row", costs)
    write_json("speculative", {"end_to_end": end_to_end, "tool_call_tokens_per_step": gains, "cost": costs})
    lines = report_header("Speculative decoding with prompt-lookup drafts")
    lines += [
        f"Bundled model, greedy but where sampled, {PROMPTS} prompts a workload (`new_tokens`: the mean a prompt "
        f"made); decode tokens/s without drafts, and the ratios to it with up to {DRAFTS} drafts a step as the cost "
        "policy chooses (`cost`, the default) and with the widest step at every call (`always`, whose share of drafts "
        f"accepted and tokens a row's step yields the table gives); {args.rounds} interleaved rounds, medians, the "
        "lowest round's ratio; greedy outputs identical in every run (sampled ones are other draws of the same "
        "distribution: tests/test_speculative.py).",
        "",
        *markdown_table(end_to_end),
        "",
    ]
    if costs:
        measured = ", ".join(f"{w}: {g:.2f}" for w, g in gains.items())
        lines += [
            f"{args.shape} dims (bench/models.py): one verify step over a {COST_CONTEXT}-entry cache at position "
            f"{COST_POSITION}, random tokens, median of {COST_CALLS} (the widths taking turns); "
            "`pays_above_acceptance`: the per-draft "
            "acceptance rate above which that width yields more tokens a second than one token a row (if each "
            "draft is accepted at that rate once those before it were); `tool_call_speedup`: the tokens a row's "
            f"step yielded on the tool-call workload at that width (batch 1, every step that wide: {measured}) "
            "over the step's cost ratio, what this shape would gain on a workload that copies as much.",
            "",
            *markdown_table(costs),
            "",
        ]
    write_report("speculative", lines)


if __name__ == "__main__":
    main()
