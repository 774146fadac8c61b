"""Shared helpers for the benchmarks: timing, the BLAS kernel in use, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ONE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"  # XLA:CPU's ops on the calling thread only


def reexec_with_native_blas_if_asked(argv: list[str]):
    """`--native-blas`: rerun this process without OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (both unset together)."""
    if "--native-blas" in argv and "OPENBLAS_CORETYPE" in os.environ:
        env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def timed(fn, repeats: int = 5, warmup: int = 1, best: bool = False) -> float:
    """Median (or with `best`, minimum) wall seconds of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def gemv_streaming(rng, nbytes, threads):
    """The weight-streaming ceiling: a function of `repeats` that returns the GB/s (best of `repeats`) of `threads`
    threads each running GEMVs (one BLAS thread each) over their own share of 4 distinct float32 matrices totalling
    `nbytes`, made once here: what reading weights once per token can reach."""
    import threading

    import numpy as np
    from threadpoolctl import threadpool_limits

    mats = [rng.standard_normal((nbytes // 16 // 4096, 4096), np.float32) for _ in range(4)]
    x = rng.standard_normal(4096).astype(np.float32)

    def stream():
        workers = [threading.Thread(target=lambda ms=mats[i::threads]: [m @ x for m in ms]) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def gbps(repeats: int) -> float:
        with threadpool_limits(1, "blas"):
            return sum(m.nbytes for m in mats) / timed(stream, repeats, best=True) / 1e9

    return gbps


def batched_bench_command(binary, model, threads: int) -> list[str]:
    """llama-batched-bench (llama.cpp's or ik_llama.cpp's) on `model` with every benchmark's settings: a 4096-token
    context, batches of 2048 in micro-batches of 512, `threads` threads for decode and prefill alike."""
    sizes = ["-c", "4096", "-b", "2048", "-ub", "512"]
    return [str(binary), "-m", str(model), *sizes, "-t", str(threads), "-tb", str(threads)]


def process_memory(pid="self") -> dict[str, int]:
    """A process's memory figures (VmRSS, VmHWM, RssAnon, ...) from /proc/PID/status in bytes (empty once it has
    exited)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    fields = (line.split(":", 1) for line in lines if line.startswith(("Vm", "Rss")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields}


def comma_choices(parser, value: str, choices, flag: str) -> list[str]:
    """The names in a comma-separated option, each one of `choices`; a parser error naming them otherwise."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names or any(n not in choices for n in names):
        parser.error(f"{flag} from {', '.join(choices)}")
    return names


def machine_info() -> dict:
    from threadpoolctl import threadpool_info

    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "blas": [
            {k: info.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
            for info in threadpool_info()
            if info.get("user_api") == "blas"
        ],
    }


def print_table(title: str, rows: list[dict]):
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys, first seen first
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print(f"\n{title}")
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def markdown_table(rows: list[dict]) -> list[str]:
    """`rows` as a markdown table's lines (every row's keys as columns, first seen first; numbers as print_table)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *("| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows),
    ]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=1, default=float))
    print(f"\nwrote {path}")
    return path


REPORTS = Path(__file__).resolve().parent / "reports"


def short_commit() -> str:
    """The checkout's commit, for a report's header ("unknown" outside a git checkout)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPORTS.parent)
    return out.stdout.strip() or "unknown"


def report_header(title: str) -> list[str]:
    """A report's first lines: its title, the date, commit, CPU and the command that made it."""
    from moe_jax.doctor import cpu_model

    command = " ".join(["python", *sys.argv])
    return [
        f"# {title}",
        "",
        f"{time.strftime('%Y-%m-%d')}, commit {short_commit()}, CPU {cpu_model()}; `{command}`.",
        "",
    ]


def write_report(name: str, lines: list[str]) -> Path:
    """bench/reports/NAME.md from its lines (the benchmark's own markdown table: no figure is copied by hand)."""
    REPORTS.mkdir(exist_ok=True)
    path = REPORTS / f"{name}.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")
    return path
