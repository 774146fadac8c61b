"""The anchor cache on a hybrid model: Qwen3-Next's layer pattern (Gated DeltaNet layers, whose state cannot be cut
at a position, beside gated attention) over the agent traces of bench/agent_traces.py.

    python bench/hybrid_anchors.py [--turns N]

The model is bench/models.py's qwen3-next-small (4 layers: 3 DeltaNet + 1 attention, hidden 256, 16 experts top-4,
vocab 4096): what is measured is which prompt tokens the cache saves and that outputs stay identical, which do not
depend on the model's size. For each scenario (a: earlier turns' thinking dropped each turn; b: also an old tool
result trimmed every fourth turn), every request of the trace runs with the anchor cache and without (greedy, 4 new
tokens); the table has the prompt tokens prefilled with the cache against all of them, and whether the outputs are
identical.
Writes bench/reports/hybrid_anchors.md and bench/results/hybrid_anchors.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe_jax  # noqa: E402
from bench.common import markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from bench.infer import trace_table  # noqa: E402
from bench.models import bench_model_dir  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, help="the trace's first N turns (default: all 24)")
    args = parser.parse_args()
    model = moe_jax.load_model(bench_model_dir("qwen3-next-small"), backend="host")
    rows, detail = trace_table(model, args.turns)
    title = "Qwen3-Next layer pattern, agent traces: prompt tokens prefilled with the anchor cache vs without"
    print_table(title, rows)
    write_json("hybrid_anchors", {"turns": args.turns, "rows": rows, "detail": detail})
    header = report_header("the anchor cache on a hybrid (DeltaNet + attention) model")
    write_report("hybrid_anchors", [*header, title, "", *markdown_table(rows), ""])


if __name__ == "__main__":
    main()
