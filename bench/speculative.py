"""Speculative decoding with prompt-lookup drafts: what it gains where outputs copy their context, what it costs
where they do not, and what a wider step costs on real layer dims.

    python bench/speculative.py [--rounds 3] [--shape qwen3-30b-a3b] [--quants bf16,int4] [--skip-cost]

1. The bundled model (pretrained to copy and sort words, never to reverse them) on its own tasks: `copy` prompts,
   whose answers repeat the prompt's word (drafts accepted), and `sort` / `reverse` prompts, whose answers are
   permutations (drafts mostly rejected). Greedy decode tokens/s without drafts, with up to 7 as the cost policy
   chooses (the default) and with drafts verified at every step, at batch 1 and 16, the sides interleaved over the
   rounds, medians; the outputs must be identical. Random-weight models never copy their context, so acceptance is
   measured here.
2. The cost side on a shape's real layer dims (default Qwen3-30B-A3B, 2 layers): one verify step's seconds at 1, 2,
   4 and 8 tokens a row for 1 and 16 rows, random tokens (uniform routing: the most experts a wider step can add),
   medians; the ratio to one token a row and the acceptance rate at which each width starts to pay (where
   1 + a + ... + a^(w-1) equals the step's cost ratio).
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

import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.common import comma_choices, markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from bench.models import bench_model_dir, use_shape  # noqa: E402
from bench.vs_llamacpp import PAIRS  # noqa: E402
from moe_jax import bundled  # noqa: E402
from moe_jax.data.tasks import prompt, random_word  # noqa: E402
from moe_jax.generation.engine import GenerationEngine, Request  # noqa: E402

DRAFTS = 7
PROMPTS = 128  # per task kind: runs long enough to time (the bundled model decodes thousands of tokens a second)
NEW_TOKENS = 16  # at most: the bundled model's answers end at EOS after a word
KINDS = {"copy": ("copy",), "sort / reverse": ("sort", "reverse")}
COST_WIDTHS = (1, 2, 4, 8)
COST_ROWS = (1, 16)
COST_CONTEXT, COST_POSITION, COST_CALLS = 512, 256, 7


def task_requests(model, tasks, seed: int) -> list[Request]:
    rng = random.Random(seed)
    texts = [prompt(tasks[i % len(tasks)], random_word(rng)) for i in range(PROMPTS)]
    return [Request(model.tokenizer.encode(t), NEW_TOKENS) for t in texts]


SIDES = ("plain", "cost", "always")  # no drafts; --draft-tokens DRAFTS as the cost policy decides; drafting always


def decode_run(model, requests, batch: int, side: str) -> dict:
    drafts = 0 if side == "plain" else DRAFTS
    engine = GenerationEngine(model, batch, 64, drafts=drafts, draft_policy="cost" if side == "plain" else side)
    completions = engine.run(requests, eos_ids=model.config.eos_token_ids)
    st = engine.stats
    return {
        "tokens": [c.tokens for c in completions],
        "tok_s": st.decode_tokens / st.decode_s,
        "acceptance": st.acceptance,
        "tokens_per_call": st.decode_tokens / max(st.decode_calls, 1),
    }


def bundled_rows(rounds: int) -> list[dict]:
    model = moe_jax.load_model(bundled.MODEL)
    rows = []
    for kind, tasks in KINDS.items():
        requests = task_requests(model, tasks, seed=len(kind))
        for batch in (1, 16):
            for side in SIDES:  # compiles every step each side takes
                decode_run(model, requests, batch, side)
            runs = {side: [] for side in SIDES}
            for i in range(rounds):
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    runs[side].append(decode_run(model, requests, batch, side))
            plain = runs["plain"]
            if any(run["tokens"] != plain[0]["tokens"] for side in SIDES for run in runs[side]):
                raise AssertionError(f"{kind}, batch {batch}: speculative outputs differ from plain decoding")
            row = {"prompts": kind, "batch": batch, "plain_tok_s": statistics.median(r["tok_s"] for r in plain)}
            for side in SIDES[1:]:
                ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(plain, runs[side], strict=True)]
                row[f"{side}_ratio"] = statistics.median(ratios)
                row[f"{side}_lowest"] = min(ratios)
            always = runs["always"]
            row["acceptance"] = statistics.median(r["acceptance"] for r in always)  # drafts verified whatever the cost
            row["always_tokens_per_call"] = statistics.median(r["tokens_per_call"] for r in always)
            rows.append(row)
    return rows


def verify_seconds(model, rows: int, width: int) -> float:
    """The median seconds of one verify step of `width` random tokens for each of `rows` rows."""
    rng = np.random.default_rng(rows * width)
    engine = GenerationEngine(model, rows, COST_CONTEXT)
    with engine.batch(rows) as batch:
        caches = batch.caches
        positions = np.broadcast_to(COST_POSITION + np.arange(width, dtype=np.int32), (rows, width))
        times = []
        for i in range(COST_CALLS + 1):  # the first compiles
            tokens = rng.integers(0, model.config.vocab_size, (rows, width), dtype=np.int32)
            start = time.perf_counter()
            chosen, caches = engine.verify(caches, tokens, positions)
            np.asarray(chosen)
            if i:
                times.append(time.perf_counter() - start)
        batch.caches = caches
    return statistics.median(times)


def break_even(cost_ratio: float, width: int) -> float:
    """The acceptance rate a at which 1 + a + ... + a^(width - 1) tokens a step equal the step's cost ratio."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(width)) < cost_ratio else (lo, a)
    return (lo + hi) / 2


def cost_rows(shape: str, quants: list[str]) -> list[dict]:
    use_shape(shape)
    rows = []
    for quant in quants:
        model = moe_jax.load_model(bench_model_dir(), backend="host", **PAIRS[quant].settings)
        for n in COST_ROWS:
            base = None
            for width in COST_WIDTHS:
                seconds = verify_seconds(model, n, width)
                base = base or seconds
                ratio = seconds / base
                rows.append(
                    {
                        "quant": quant,
                        "rows": n,
                        "tokens_a_row": width,
                        "step_ms": seconds * 1e3,
                        "cost_ratio": ratio,
                        "pays_above_acceptance": break_even(ratio, width) if width > 1 else None,
                    }
                )
        del model
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="the cost table's shape (bench/models.py)")
    parser.add_argument("--quants", default="bf16,int4", help="the cost table's formats, from " + ", ".join(PAIRS))
    parser.add_argument("--skip-cost", action="store_true", help="only the bundled model's table")
    args = parser.parse_args()
    quants = comma_choices(parser, args.quants, [p for p in PAIRS if p != "mxfp4"], "--quants")
    end_to_end = bundled_rows(args.rounds)
    print_table(f"bundled model, greedy decode tok/s without drafts; ratios with up to {DRAFTS}", end_to_end)
    costs = [] if args.skip_cost else cost_rows(args.shape, quants)
    if costs:
        print_table(f"{args.shape}: one verify step by tokens a row", costs)
    write_json("speculative", {"end_to_end": end_to_end, "cost": costs})
    lines = report_header("Speculative decoding with prompt-lookup drafts")
    lines += [
        f"Bundled model, greedy, {PROMPTS} prompts a kind, up to {NEW_TOKENS} new tokens (its answers end at EOS "
        f"after a word: a few tokens each); decode tokens/s without drafts, and the ratios to it with up to {DRAFTS} "
        "drafts a step as the cost policy chooses (`cost`, the default) and verified at every step (`always`, whose "
        f"acceptance rate the table gives); {args.rounds} interleaved rounds, medians, the lowest round's ratio; "
        "outputs identical in every run.",
        "",
        *markdown_table(end_to_end),
        "",
    ]
    if costs:
        lines += [
            f"{args.shape} dims (bench/models.py): one verify step over a {COST_CONTEXT}-entry cache at position "
            f"{COST_POSITION}, random tokens, median of {COST_CALLS}; `pays_above_acceptance`: the per-draft "
            "acceptance rate above which that width yields more tokens a second than one token a row.",
            "",
            *markdown_table(costs),
            "",
        ]
    write_report("speculative", lines)


if __name__ == "__main__":
    main()
