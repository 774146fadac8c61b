"""`moe-jax report RUN [--out FILE]`: a run's figures as one self-contained HTML page.

How it works and why: docs/INTERNALS.md, moe_jax/report.py.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax.cli import prog, run_cli  # noqa: E402
from moe_jax.errors import InputError  # noqa: E402
from moe_jax.output_files import write_text  # noqa: E402

# (title, [(record key, label)], y-axis label): one plot each, drawn when any record has one of its keys
CURVES = [
    ("Loss", [("loss", "train"), ("eval_loss", "held out")], "loss"),
    ("Held-out exact match", [("exact_match", "exact match")], "fraction"),
    ("Learning rate", [("lr", "learning rate")], "lr"),
    ("Throughput", [("tokens_per_s", "tokens/s")], "tokens/s"),
    ("Host busy", [("host_busy_pct", "host expert calls")], "% of wall time"),
    ("Waits", [("device_wait_s", "device waits for host"), ("host_wait_s", "host waits for device")], "seconds"),
    ("Bus", [("bus_gbps", "both directions")], "GB/s"),
    ("Host experts", [("host_gflops", "GFLOP/s"), ("host_weight_gbps", "weight GB/s")], "rate"),
    ("Expert skew", [("expert_skew", "busiest / mean, averaged over layers")], "ratio"),
    ("Anchor cache", [("anchor_hits", "hits"), ("anchor_reused_tokens", "reused prompt tokens")], "count"),
]


def read_records(run: Path) -> tuple[Path, list[dict]]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise InputError(f"{path}: no such file (give a train.py run directory or a JSONL file of records)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise InputError(f"{path}:{number}: a record must be an object with an integer 'step'")
        records.append(record)
    if not records:
        raise InputError(f"{path}: no records")
    return path, records


def expert_heat_map(records: list[dict]) -> tuple[list[int], np.ndarray] | None:
    """(MoE layer indices, [layers, experts]: each layer's share of its routed tokens per expert), summed over the
    records' counts; None when no record has counts."""
    totals: dict[int, np.ndarray] = {}
    for record in records:
        for layer, counts in (record.get("tokens_per_expert") or {}).items():
            counts = np.asarray(counts, np.float64)
            totals[int(layer)] = totals[int(layer)] + counts if int(layer) in totals else counts
    if not totals:
        return None
    width = max(len(c) for c in totals.values())
    grid = np.zeros((len(totals), width))
    for row, (_, counts) in enumerate(sorted(totals.items())):
        grid[row, : len(counts)] = counts / max(counts.sum(), 1.0)
    return sorted(totals), grid


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def curve_images(records: list[dict]) -> list[tuple[str, str]]:
    images = []
    for title, series, unit in CURVES:
        drawn = [(key, label) for key, label in series if any(_number(r.get(key)) for r in records)]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        for key, label in drawn:
            points = [(r["step"], r[key]) for r in records if _number(r.get(key))]
            ax.plot(*zip(*points, strict=True), "o-" if len(points) < 20 else "-", ms=3, lw=1.2, label=label)
        ax.set(title=title, xlabel="step", ylabel=unit)
        ax.grid(alpha=0.3)
        if len(drawn) > 1:
            ax.legend()
        images.append((title, _png(fig)))
    return images


def heat_map_image(layers: list[int], grid: np.ndarray) -> str:
    fig, ax = plt.subplots(figsize=(min(12, 3 + 0.12 * grid.shape[1]), 1.2 + 0.3 * grid.shape[0]))
    shown = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    step = max(1, len(layers) // 24)  # at most ~24 labels
    ax.set_yticks(range(0, len(layers), step), [str(layer) for layer in layers[::step]])
    ax.set(title="Tokens per expert (share of each layer's routed tokens)", xlabel="expert", ylabel="MoE layer")
    fig.colorbar(shown, ax=ax, fraction=0.03)
    return _png(fig)


def render(path: Path, records: list[dict]) -> str:
    figures = [_figure(title, png) for title, png in curve_images(records)]
    heat_map = expert_heat_map(records)
    if heat_map is not None:
        figures.append(_figure("expert heat map", heat_map_image(*heat_map), "wide"))
    last = {k: v for r in records for k, v in r.items() if _number(v)}
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in sorted(last.items()))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>moe_jax run: {html.escape(str(path))}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
.figures {{ display: flex; flex-wrap: wrap; gap: 1em; }}
figure {{ margin: 0; }} figure.wide {{ flex-basis: 100%; }}
table {{ border-collapse: collapse; margin-top: 1em; }} td {{ padding: 2px 10px; border-bottom: 1px solid #ddd; }}
</style></head><body>
<h1>moe_jax run</h1>
<p>{html.escape(str(path))}: {len(records)} records, steps {records[0]["step"]} to {records[-1]["step"]}</p>
<div class="figures">{"".join(figures)}</div>
<h2>Last values</h2><table>{rows}</table>
</body></html>
"""


def _figure(title: str, png: str, kind: str = "") -> str:
    return f"<figure class='{kind}'><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'></figure>"


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def main(argv=None):
    parser = argparse.ArgumentParser(prog=prog("report"), description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="train.py run directory, or a JSONL file of records")
    parser.add_argument("--out", type=Path, help="HTML file to write (default: RUN/report.html or NAME.html)")
    args = parser.parse_args(argv)
    path, records = read_records(args.run)
    out = args.out or (args.run / "report.html" if args.run.is_dir() else path.with_suffix(".html"))
    write_text(out, render(path, records))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
