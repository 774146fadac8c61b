"""The cost model against measurement: predicted vs measured layer time, host lane and device lane.

    python bench/cost_model.py [--profile probe.json] [--quick]

Uses a probe profile (runs the probe first when none is given), then for uniform and Zipf routings at decode
and prefill sizes (4 routing draws each, averaged) times one layer of 8 experts of the profile's shape through
host_kernels (host lane) and through the pure-JAX path on device-resident weights (device lane), and prints
predicted / measured.
Writes bench/results/cost_model.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import print_table, timed, write_json  # noqa: E402
from bench.host_kernels import make_routing  # noqa: E402
from host_kernels.host_moe import HostMoE  # noqa: E402
from host_kernels.layer_experts import LayerExperts  # noqa: E402
from host_kernels.store import ExpertStore  # noqa: E402
from moe_jax.model.moe import DeviceExperts  # noqa: E402
from moe_jax.planning.cost_model import Profile, layer_time  # noqa: E402

ROUTINGS = 4  # routing draws per point


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.profile is None:
        from moe_jax.planning import probe

        args.profile = Path(tempfile.gettempdir()) / "moe_jax_probe.json"
        probe.main(["--out", str(args.profile)] + (["--quick"] if args.quick else []))
    profile = Profile.load(args.profile)
    import json

    shape = json.loads(args.profile.read_text())["expert"]
    d, f, e, k = shape["hidden"], shape["ffn"], 8, 2
    rng = np.random.default_rng(0)
    layer = LayerExperts(
        (rng.standard_normal((e, d, 2 * f)) / np.sqrt(d)).astype(np.float32),
        (rng.standard_normal((e, f, d)) / np.sqrt(f)).astype(np.float32),
    )
    engine = HostMoE(ExpertStore({0: layer}))
    device = DeviceExperts(jnp.asarray(layer.w13), jnp.asarray(layer.w2))
    device_forward = jax.jit(lambda x, ids, w: device(x, ids, w))
    rows = []
    for tokens in [1, 16, 256] if args.quick else [1, 4, 16, 64, 256, 1024, 2048]:
        for skew in (0.0, 1.5):
            # several routings per point: which experts a small batch lands on moves XLA:CPU's time by ~30%,
            # and the model predicts the expected time, so both sides are averaged over the same draws
            host_pred = host_measured = dev_pred = dev_measured = 0.0
            for _ in range(ROUTINGS):
                x = rng.standard_normal((tokens, d)).astype(np.float32)
                ids, w = make_routing(rng, tokens, e, k, skew)
                counts = np.bincount(ids.ravel(), minlength=e).tolist()
                host_measured += timed(lambda x=x, ids=ids, w=w: engine.forward(0, x, ids, w), 5, best=True)
                dev_measured += timed(
                    lambda x=x, ids=ids, w=w: device_forward(x, ids, w).block_until_ready(), 5, best=True
                )
                host_pred += layer_time(profile, counts, ["host"] * e).host_lane
                dev_pred += layer_time(profile, counts, ["resident"] * e).device_lane
            host_pred, host_measured, dev_pred, dev_measured = (
                v / ROUTINGS for v in (host_pred, host_measured, dev_pred, dev_measured)
            )
            rows.append(
                {
                    "tokens": tokens,
                    "zipf": skew,
                    "host_pred_ms": host_pred * 1e3,
                    "host_meas_ms": host_measured * 1e3,
                    "host_pred_over_meas": host_pred / host_measured,
                    "dev_pred_ms": dev_pred * 1e3,
                    "dev_meas_ms": dev_measured * 1e3,
                    "dev_pred_over_meas": dev_pred / dev_measured,
                }
            )
    print_table("cost model: predicted / measured layer time (8 experts, top-2)", rows)
    write_json("cost_model", {"profile": str(args.profile), "rows": rows})


if __name__ == "__main__":
    main()
