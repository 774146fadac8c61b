"""The planner against static placements in a discrete-event simulation of one MoE layer, over a sweep.

    python bench/planner_sim.py [--profile probe.json] [--experts 8] [--top-k 2] [--fast-device N]

Sweeps bus bandwidth (4-64 GB/s), tokens per step (1-8192) and routing skew (Zipf 0-2), with the measured host
and device expert timings of a probe profile (runs the probe first when none is given). For each point it plays
out the planner's placement and the static ones (all-host, all-offload, hybrid splits) with
moe_jax.planning.simulate and
reports planner / best static. `--fast-device N` divides the profile's device times by N (a stand-in for an
accelerator on a machine without one). Writes bench/results/planner_sim.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_json  # noqa: E402
from moe_jax.planning.cost_model import Profile  # noqa: E402
from moe_jax.planning.simulate import summarise, sweep  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--fast-device", type=float, default=1.0, help="divide device times by this")
    args = parser.parse_args()
    if args.profile is None:
        from moe_jax.planning import probe

        args.profile = Path(tempfile.gettempdir()) / "moe_jax_probe.json"
        probe.main(["--out", str(args.profile)])
    profile = Profile.load(args.profile)
    if args.fast_device != 1.0:
        profile = dataclasses.replace(
            profile,
            device_seconds=profile.device_seconds / args.fast_device,
            device_call_s=profile.device_call_s / args.fast_device,
        )
    rows = sweep(profile, args.experts, args.top_k)
    table = [
        {k: r[k] for k in ("bus_gbps", "tokens", "zipf", "planner_ms", "best_static", "best_static_ms")}
        | {"planner_over_best": r["planner_over_best"]}
        for r in rows
        if r["zipf"] in (0.0, 2.0) and r["tokens"] in (1, 16, 256, 4096)
    ]
    print_table("planner vs the best static placement (simulated layer; excerpt)", table)
    summary = summarise(rows)
    print(summary)
    write_json(
        f"planner_sim{'_fast_device' if args.fast_device != 1.0 else ''}",
        {"profile": str(args.profile), "fast_device": args.fast_device, "summary": summary, "rows": rows},
    )


if __name__ == "__main__":
    main()
