"""`python -m moe_jax.doctor`: what this machine supports and what a model loaded here would run, and why.

Prints the CPU's kernel-relevant features, the two native libraries' state, the platform jax runs on, and the
execution plan (moe_jax/planning/plan.py) for a host-placement model in float32, in bfloat16, and in bfloat16 with int8
and with int4 experts (or why this machine cannot run those). `--json FILE` also writes it as JSON (for a bug
report). Exit code 0; nothing here changes state.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from host_kernels import HostKernelError, cpu_features, default_threads, library_status
from host_kernels.stream_worker import cuda_status
from moe_jax.cli import prog, run_cli
from moe_jax.native import ffi as native_ffi
from moe_jax.native import stream_experts
from moe_jax.planning.plan import make_plan

STORE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(native: bool | None = None) -> dict:
    """Everything doctor prints, as plain data."""
    host_ok, host_why = library_status()
    unavailable = {}
    ffi_ok, ffi_why = native_ffi.status()
    stream_ok, stream_why = stream_experts.status()
    cuda_ok, cuda_why = cuda_status()
    plans = {dtype: make_plan(dtype, store, native) for dtype, store in STORE_DTYPES.items()}
    for quant in ("int8", "int4"):
        try:
            plans[f"bfloat16, quant={quant}"] = make_plan("bfloat16", STORE_DTYPES["bfloat16"], native, quant=quant)
        except HostKernelError as e:
            unavailable[f"bfloat16, quant={quant}"] = str(e)
    return {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "host_threads": default_threads(),
        "jax": {
            "version": jax.__version__,
            "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
        },
        "native_libraries": {
            "host_kernels._native": host_why or "ok",
            "xla_ffi_handlers": ffi_why or "ok",
            "stream_handlers": stream_why or "ok",  # the stream-ordered expert calls on jax's platform
            "cuda_stream_handlers": cuda_why or "ok",  # their CUDA side: built in, and the driver loaded
        },
        "usable": {
            "host_kernels._native": host_ok,
            "xla_ffi_handlers": ffi_ok,
            "stream_handlers": stream_ok,
            "cuda_stream_handlers": cuda_ok,
        },
        "plans": {dtype: {"lines": p.lines(), **_plan_data(p)} for dtype, p in plans.items()},
        "unavailable": unavailable,
    }


def _plan_data(plan) -> dict:
    data = asdict(plan)
    data["why"] = dict(plan.why)
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog("doctor"), description=__doc__.split("\n\n")[0])
    p.add_argument("--no-native", action="store_true", help="show the plan with native code turned off")
    p.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    args = p.parse_args(argv)
    r = report(native=False if args.no_native else None)
    features = " ".join(f"{flag}{'' if has else ' (no)'}" for flag, has in r["cpu_features"].items())
    lines = [
        f"CPU: {r['cpu']}, {r['host_threads']} host threads by default",
        f"CPU features: {features}",
        f"jax {r['jax']['version']} on {r['jax']['platform']}: {', '.join(r['jax']['devices'])}",
        *(f"{name}: {state}" for name, state in r["native_libraries"].items()),
    ]
    for dtype, plan in r["plans"].items():
        lines.append(f"\na {dtype} model with backend=host runs:")
        lines += [f"  {line}" for line in plan["lines"]]
    lines += [f"\na {dtype} model: not here ({why})" for dtype, why in r["unavailable"].items()]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
