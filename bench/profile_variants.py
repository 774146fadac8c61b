"""Probe profiles that stress backend="auto": a measured profile whose device is made to win at small sizes.

    python bench/profile_variants.py --profile probe.json --out DIR [--rows 4] [--factor 2]

From one measured profile (`python -m moe_jax.probe`) writes:
  device_wins_small.json           the device's per-expert time at <= --rows rows set to the host's / --factor,
                                   its fixed cost per call kept as measured;
  device_wins_small_no_call.json   the same with no fixed device cost per call: a device that wins whole decode
                                   layers on paper. On a machine whose "device" is its own CPU this profile is
                                   wrong about the machine; auto trusts it, so it shows what a misleading probe
                                   costs.
Feed them to `bench/backends.py --profile` and `bench/infer.py --profile`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def device_wins_small(profile: dict, rows: int, factor: float, call_cost: bool) -> dict:
    host = {r["rows"]: r["seconds"] for r in profile["host"]}
    out = json.loads(json.dumps(profile))
    for r in out["device"]:
        if r["rows"] <= rows:
            r["seconds"] = host[r["rows"]] / factor
    if not call_cost:
        out["device_call_s"] = 0.0
    suffix = "" if call_cost else ", no call cost"
    out["variant"] = f"device {factor}x faster than the host at <= {rows} rows{suffix}"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0)
    args = parser.parse_args()
    measured = json.loads(args.profile.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for name, call_cost in (("device_wins_small", True), ("device_wins_small_no_call", False)):
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(device_wins_small(measured, args.rows, args.factor, call_cost), indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
