"""The anchor cache on a hybrid model: Qwen3-Next's layer pattern (Gated DeltaNet layers, whose state cannot be cut
at a position, beside gated attention) over the agent traces of bench/agent_traces.py.

    python bench/hybrid_anchors.py [--turns N]

The model is a small random Qwen3-Next (4 layers: 3 DeltaNet + 1 attention, hidden 256, 16 experts top-4, vocab
4096): what is measured is which prompt tokens the cache saves and that outputs stay identical, which do not depend
on the model's size. For each scenario (a: earlier turns' thinking dropped each turn; b: also an old tool result
trimmed every fourth turn), every request of the trace runs with the anchor cache and without (greedy, 4 new tokens);
the table has the prompt tokens prefilled with the cache against all of them, and whether the outputs are identical.
Writes bench/reports/hybrid_anchors.md and bench/results/hybrid_anchors.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe_jax  # noqa: E402
from bench.common import markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from bench.infer import trace_table  # noqa: E402

SMALL_QWEN3_NEXT = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,  # transformers' default pattern: full attention every 4th layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=4096,
)


def small_model_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "moe_jax_bench_qwen3_next_small"
    if not (path / "config.json").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**SMALL_QWEN3_NEXT))
        partial = path.with_name(path.name + ".partial")
        model.save_pretrained(partial)
        partial.rename(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, help="the trace's first N turns (default: all 24)")
    args = parser.parse_args()
    model = moe_jax.load_model(small_model_dir(), backend="host")
    rows, detail = trace_table(model, args.turns)
    title = "Qwen3-Next layer pattern, agent traces: prompt tokens prefilled with the anchor cache vs without"
    print_table(title, rows)
    write_json("hybrid_anchors", {"turns": args.turns, "rows": rows, "detail": detail})
    header = report_header("the anchor cache on a hybrid (DeltaNet + attention) model")
    write_report("hybrid_anchors", [*header, title, "", *markdown_table(rows), ""])


if __name__ == "__main__":
    main()
