"""A known-good client's latency while hostile requests are in flight, on the bundled model.

    python bench/serve_hostile.py [--rounds 8] [--per-round 3]

`python -m moe_jax.serve` (a child process, default limits, two API keys) answers one short chat request at a time
from a victim, in rounds that alternate: the attacker paused, then the attacker sending, one after another, a
4 MB chat message and a 6 MB prompt (both 413 by size), a 20,000-character message (400 by characters) and a
1,600-character prompt (400 after tokenizing its first tokens). Side-by-side rounds see the same machine load.
Prints and writes the victim's median latency in both and their ratio, each hostile request's median answer
time, and the server's resident memory before and after; bench/reports/serve_hostile.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, process_memory, short_commit, write_json, write_report  # noqa: E402
from moe_jax.doctor import cpu_model  # noqa: E402
from moe_jax.serving.process import running_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL, NAME = ROOT / "models" / "tiny-moe", "tiny-moe"
VICTIM, ATTACKER = {"authorization": "Bearer victim-key"}, {"x-api-key": "attacker-key"}
GOOD_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "copy srel >"}], "max_tokens": 8, "temperature": 0}
HOSTILE = [  # (what, path, body, expected status)
    ("4 MB chat message", "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * (2 << 20)}]}, 413),
    ("6 MB prompt", "/v1/completions", {"prompt": "ab " * (1 << 20)}, 413),
    ("20k-char chat message", "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * 10_000}]}, 400),
    ("1,600-char prompt", "/v1/completions", {"prompt": "a" * 1600}, 400),
]


def rss_mb(pid: int) -> float:
    rss = process_memory(pid).get("VmRSS")
    if rss is None:
        raise RuntimeError(f"no VmRSS for process {pid}")
    return rss / 2**20


def victim_latency(server) -> float:
    start = time.perf_counter()
    status, answer, _ = server.post("/v1/chat/completions", GOOD_CHAT, VICTIM)
    if status != 200:
        raise RuntimeError(f"the victim's request got {status}: {answer}")
    return time.perf_counter() - start


def measure(server, rounds: int, per_round: int) -> dict:
    bodies = [(what, path, json.dumps({"model": NAME, **body}).encode(), s) for what, path, body, s in HOSTILE]
    answers: dict[str, list[float]] = {what: [] for what, *_ in HOSTILE}
    attacking, done, failures = threading.Event(), threading.Event(), []

    def attack():
        while not done.is_set():
            for what, path, body, expected in bodies:
                attacking.wait()
                start = time.perf_counter()
                status, answer, _ = server.post(path, body, ATTACKER)
                if status != expected:
                    failures.append((what, status, answer))
                answers[what].append(time.perf_counter() - start)

    for _ in range(3):  # the victim's shapes compiled before anything is timed
        victim_latency(server)
    rss_before = rss_mb(server.process.pid)
    attacker = threading.Thread(target=attack)
    attacker.start()
    quiet, under_attack = [], []
    try:
        for _ in range(rounds):
            quiet += [victim_latency(server) for _ in range(per_round)]
            attacking.set()
            time.sleep(0.1)
            under_attack += [victim_latency(server) for _ in range(per_round)]
            attacking.clear()
    finally:
        done.set()
        attacking.set()
        attacker.join()
    if failures:
        raise RuntimeError(f"hostile requests answered unexpectedly: {failures[:3]}")
    time.sleep(1.0)
    return {
        "victim_quiet_ms": 1e3 * statistics.median(quiet),
        "victim_under_attack_ms": 1e3 * statistics.median(under_attack),
        "victim_ratio": statistics.median(under_attack) / statistics.median(quiet),
        "hostile_ms": {what: 1e3 * statistics.median(times) for what, times in answers.items() if times},
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_mb(server.process.pid),
    }


def report(args, result: dict) -> Path:
    lines = [
        "# A victim's latency with hostile requests in flight",
        "",
        f"{datetime.date.today()}, commit {short_commit()}, CPU {cpu_model()}; "
        f"`python bench/serve_hostile.py --rounds {args.rounds} --per-round {args.per_round}` "
        "(the bundled model, default limits; the bench client shares the server's cores).",
        "",
        "| victim, attacker paused | victim, attacker sending | ratio |",
        "|---|---|---|",
        f"| {result['victim_quiet_ms']:.1f} ms | {result['victim_under_attack_ms']:.1f} ms "
        f"| {result['victim_ratio']:.2f} |",
        "",
        "| hostile request | answered in (median) |",
        "|---|---|",
        *(f"| {what} | {ms:.1f} ms |" for what, ms in result["hostile_ms"].items()),
        "",
        f"Server resident memory: {result['rss_before_mb']:.0f} MB before, {result['rss_after_mb']:.0f} MB after.",
        "",
    ]
    return write_report("serve_hostile", lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="pairs of quiet and attacked rounds")
    parser.add_argument("--per-round", type=int, default=3, help="victim requests per round")
    args = parser.parse_args()
    server_args = ["--model", str(MODEL), "--api-key", "victim-key", "--api-key", "attacker-key"]
    log = Path(tempfile.mkdtemp(prefix="moe_jax_bench_hostile_")) / "server.log"
    with running_server(server_args, log) as server:
        result = measure(server, args.rounds, args.per_round)
    print_table("victim latency, attacker paused vs sending", [{k: v for k, v in result.items() if k != "hostile_ms"}])
    print_table("hostile requests' answer time", [{"request": w, "ms": ms} for w, ms in result["hostile_ms"].items()])
    write_json("serve_hostile", {"result": result, "args": vars(args)})
    report(args, result)


if __name__ == "__main__":
    main()
