"""A whole model of the size users run, on this machine: Qwen3-30B-A3B's config (48 layers of 128 experts, the
151,936-token vocabulary, an untied head) with random weights in one Q4_0 GGUF file, through moe_jax and llama.cpp.

    python bench/full_scale.py [--llama-cpp DIR] [--work DIR] [--rounds 3] [--skip direct,train]

Every step runs in its own process, its memory sampled from /proc (peak resident set, and of it the anonymous
part: file pages are the page cache's to drop, anonymous ones are what gets a process killed):
1. the file, written by bench/full_scale_gguf.py (kept in --work for later runs);
2. `moe_jax.convert --gguf` into a converted directory (its time and memory);
3. moe_jax loading the file directly (its Q4_0 experts repacked as int4 in RAM): load time, time to first token;
4. `--rounds` rounds, in alternating order, of moe_jax on the converted directory (load, first token, then decode
   of 32-token prompts at batch 1 and 16 sampling 32 tokens at temperature 1, prefill of one 512- and one
   2048-token prompt) and llama.cpp's llama-batched-bench on the same file (the same cases; it feeds random ids,
   so both sides route as text does); per case the median of the rounds' own ratios, with the lowest;
5. one LoRA training step (attention q/k/v/o, rank 8) on the int4 base, batch 1 x 512 (bench/train.py's loop).
moe_jax's peak resident set while decoding is set against what it must hold: the expert store plus every live
JAX array (dense weights, their packed copies for the decode kernels, the KV cache). Writes
bench/reports/full_scale.md and bench/results/full_scale.json; the steps `--skip` leaves out keep their figures
from the last run that measured them (the results file), the report naming its commit. Needs ~35 GB of disk in
--work (the file and the converted directory) and llama.cpp built as bench/vs_llamacpp.py says (without it, its
rows are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS,
    batched_bench_command,
    markdown_table,
    print_table,
    process_memory,
    report_header,
    short_commit,
    write_json,
    write_report,
)
from bench.full_scale_gguf import FULL_SHAPES  # noqa: E402

PROMPT, NEW, BATCHES, PREFILLS = 32, 32, (1, 16), (512, 2048)
CASES = [*(f"decode b{b}" for b in BATCHES), *(f"prefill {n}" for n in PREFILLS)]
TEMPERATURE = 1.0  # moe_jax samples (random weights' greedy tokens cycle among a few, whose experts stay cached)
THREADS = os.cpu_count()
RESULT = "RESULT "  # a child's line carrying its JSON result
GIB = 2**30


class MemoryPeak:
    """The peak VmRSS and RssAnon of a running process, polled from /proc every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every, self.rss, self.anon = pid, every, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._done.is_set():
            status = process_memory(self.pid)
            if status:
                self.rss, self.anon = max(self.rss, status["VmRSS"]), max(self.anon, status["RssAnon"])
            self._done.wait(self.every)

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        return {"peak_rss_gib": self.rss / GIB, "peak_anon_gib": self.anon / GIB}


def run_measured(cmd: list[str], what: str) -> tuple[str, float, dict]:
    """Runs `cmd`, sampling its memory: (its stdout, wall seconds, peaks); exits naming `what` if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = MemoryPeak(proc.pid)
    out, err = proc.communicate()
    seconds, memory = time.perf_counter() - start, peak.stop()
    if proc.returncode != 0:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise StepFailed(f"{what} failed ({how}, peak RSS {memory['peak_rss_gib']:.1f} GiB):\n{err[-3000:]}")
    return out, seconds, memory


class StepFailed(Exception):
    """A measured step's process failed: its exit and the end of what it wrote to stderr."""


def recorded(step) -> dict:
    """`step()`'s result, or {"failed": why} where its process failed (the report says so; the run goes on)."""
    try:
        return step()
    except StepFailed as e:
        print(e, file=sys.stderr)
        return {"failed": str(e).splitlines()[0]}


def child_result(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith(RESULT))[len(RESULT) :])


# --- the children: moe_jax in a process of its own ---


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the next peak is the next phase's


def child_generate(source: str, cases: list[str]):
    """Loads `source`, times its first token, then runs `cases`: one JSON line of tokens/s and memory per case."""
    import jax

    import moe_jax
    from bench.infer import engine_runner

    start = time.perf_counter()
    model = moe_jax.load_model(source, backend="host", host_threads=THREADS)
    result = {"load_s": time.perf_counter() - start, "load_peak_rss_gib": process_memory()["VmHWM"] / GIB}
    first = engine_runner(model, 1, 1, PROMPT)  # compiles and runs once: the first token as a user waits for it
    result["first_token_s"] = time.perf_counter() - start - result["load_s"]
    del first
    result["store_gib"] = model.placement.runtime.compute.store.nbytes / GIB
    for case in cases:
        reset_peak()
        batch, new, prompt = (int(case[8:]), NEW, PROMPT) if case.startswith("decode") else (1, 0, int(case[8:]))
        runner = engine_runner(model, batch, new, prompt, temperature=TEMPERATURE)
        model.metrics()  # the routing counts from here on are the timed run's
        speed = runner()["decode_tok_s" if new else "prefill_tok_s"]
        live = held_bytes(jax.live_arrays())  # the dense weights, their packed copies, the KV cache
        result[case] = {"tok_s": speed, "peak_rss_gib": process_memory()["VmHWM"] / GIB, "live_arrays_gib": live / GIB}
        result[case] |= routing_spread(model.metrics().tokens_per_expert)
        del runner
    print(RESULT + json.dumps(result), flush=True)


def held_bytes(arrays) -> int:
    """The bytes of JAX arrays, each buffer once: numpy's view of an array on XLA:CPU is listed as a live array of
    its own over the same memory (every weight packed from was counted twice)."""
    return sum({a.unsafe_buffer_pointer(): a.nbytes for a in arrays}.values())


def routing_spread(tokens_per_expert: dict) -> dict:
    """How the run's tokens spread over each layer's experts (means over layers): the share of experts that got
    any, and the busiest expert's tokens over the mean. Text spreads over nearly all of them at a prefill's size;
    a random-weight model whose hidden states collapse sends everything to a few (bench/full_scale_gguf.py)."""
    if not tokens_per_expert:
        return {}
    counts = [np.asarray(c, np.float64) for c in tokens_per_expert.values()]
    used = statistics.mean(float((c > 0).mean()) for c in counts)
    return {"experts_used": used, "busiest_over_mean": statistics.mean(float(c.max() / c.mean()) for c in counts)}


def child_train(source: str):
    """One LoRA step on `source` at batch 1 x 512 after bench/train.py's two warm-up steps."""
    from bench.train import run_moe_jax

    times, losses, _ = run_moe_jax("host", "bfloat16", 1, 512, 1, checkpoint=source, threads=THREADS)
    result = {"step_s": times[0], "tok_s": 512 / times[0], "losses": losses}
    print(RESULT + json.dumps(result), flush=True)


def moe_jax_run(source: Path, cases: list[str]) -> dict:
    out, seconds, memory = run_measured(
        [sys.executable, __file__, "--child", "generate", str(source), ",".join(cases)], f"moe_jax on {source}"
    )
    return {**child_result(out), "process_s": seconds, **memory}


# --- llama.cpp ---


def llama_run(tools: dict, model: Path) -> dict:
    """llama-batched-bench on `model`: the decode cases in one process, the prefill ones in another."""
    base = [*batched_bench_command(tools["batched_bench"], model, THREADS), "--output-format", "jsonl"]
    decode = ["-npp", str(PROMPT), "-ntg", str(NEW), "-npl", ",".join(map(str, BATCHES))]
    prefill = ["-npp", ",".join(map(str, PREFILLS)), "-ntg", "1", "-npl", "1"]
    result, peaks = {}, []
    for args, key in ((decode, "speed_tg"), (prefill, "speed_pp")):
        out, _, memory = run_measured(base + args, f"llama-batched-bench {' '.join(args)}")
        peaks.append(memory)
        for row in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
            case = f"decode b{row['pl']}" if key == "speed_tg" else f"prefill {row['pp']}"
            result[case] = {"tok_s": row[key]}
    result["peak_rss_gib"] = max(p["peak_rss_gib"] for p in peaks)
    result["peak_anon_gib"] = max(p["peak_anon_gib"] for p in peaks)
    return result


def llama_tools(directory: Path | None) -> dict | None:
    if directory is None:
        return None
    tools = {"batched_bench": directory / "build" / "bin" / "llama-batched-bench"}
    if not tools["batched_bench"].exists():
        sys.exit(f"{tools['batched_bench']} is missing: build llama.cpp as bench/vs_llamacpp.py says")
    return tools


# --- the run ---


def rounds_table(rounds: list[dict], cases: list[str]) -> list[dict]:
    rows = []
    for case in cases:
        ours = [r["moe_jax"][case]["tok_s"] for r in rounds]
        row = {"case": case, "moe_jax tok/s": statistics.median(ours)}
        paired = [r for r in rounds if case in r.get("llama.cpp", {})]  # (a run that printed no row is left out)
        theirs = [r["llama.cpp"][case]["tok_s"] for r in paired]
        if theirs:
            ratios = [r["moe_jax"][case]["tok_s"] / r["llama.cpp"][case]["tok_s"] for r in paired]
            row |= {"llama.cpp tok/s": statistics.median(theirs), "ratio": statistics.median(ratios)}
            row |= {"lowest round": min(ratios)}
        rows.append(row)
    return rows


def memory_rows(moe: dict) -> list[dict]:
    """Per case, moe_jax's peak resident set against the store + live arrays it holds, and how its tokens spread
    over the experts (routing_spread)."""
    rows = []
    for case in CASES:
        held = moe["store_gib"] + moe[case]["live_arrays_gib"]
        rows.append({"case": case, "peak RSS GiB": moe[case]["peak_rss_gib"], "store + live arrays GiB": held})
        rows[-1]["ratio"] = moe[case]["peak_rss_gib"] / held
        rows[-1] |= {k: moe[case][k] for k in ("experts_used", "busiest_over_mean") if k in moe[case]}
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--shape", choices=list(FULL_SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe_jax_full_scale"), help="where the files go")
    parser.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"), help="llama.cpp tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated: convert (step 2, reusing the converted directory), direct (step 3), train (step 5)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "train":
            return child_train(*rest)
        return child_generate(rest[0], rest[1].split(",") if rest[1] else [])
    skip = set(filter(None, args.skip.split(",")))
    tools = llama_tools(args.llama_cpp)
    args.work.mkdir(parents=True, exist_ok=True)
    gguf_path, converted = args.work / f"{args.shape}-q4_0.gguf", args.work / f"{args.shape}-int4"
    report = {"shape": args.shape, "threads": THREADS}
    if not gguf_path.exists():
        writer = [sys.executable, str(Path(__file__).with_name("full_scale_gguf.py")), "--shape", args.shape]
        _, report["write_s"], report["write_memory"] = run_measured([*writer, "--out", str(gguf_path)], "writing")
    report["gguf_gib"] = gguf_path.stat().st_size / GIB
    if "convert" not in skip or not converted.exists():
        convert = [sys.executable, "-m", "moe_jax.convert", "--gguf", str(gguf_path), "--out", str(converted)]
        convert += ["--overwrite", "--no-progress"]
        _, report["convert_s"], report["convert_memory"] = run_measured(convert, "convert")
    report["converted_gib"] = sum(f.stat().st_size for f in converted.rglob("*") if f.is_file()) / GIB
    report |= carried_over(skip, args.shape)
    print(json.dumps(report, indent=1), flush=True)
    if "direct" not in skip:
        report["direct"] = recorded(lambda: moe_jax_run(gguf_path, ["decode b1"]))
        print("direct:", json.dumps(report["direct"]), flush=True)
    rounds = []
    for i in range(args.rounds):
        sides = {"moe_jax": lambda: moe_jax_run(converted, CASES)}
        if tools:
            sides["llama.cpp"] = lambda: llama_run(tools, gguf_path)
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        rounds.append({name: sides[name]() for name in order})
        print(f"round {i + 1}:", json.dumps(rounds[-1]), flush=True)
    report["rounds"] = rounds
    if "train" not in skip:

        def train():
            out, seconds, memory = run_measured([sys.executable, __file__, "--child", "train", str(converted)], "train")
            return {**child_result(out), "process_s": seconds, **memory}

        report["train"] = recorded(train)
    speed, memory = rounds_table(rounds, CASES), memory_rows(rounds[-1]["moe_jax"])
    print_table("tokens/s", speed)
    print_table("moe_jax's memory (last round)", memory)
    write_json("full_scale", {**report, "commit": short_commit()})
    write_report("full_scale", full_report(report, speed, memory))


CARRIED_STEPS = {"convert": ("convert_s", "convert_memory"), "direct": ("direct",), "train": ("train",)}


def carried_over(skip: set[str], shape: str) -> dict:
    """The skipped steps' results from the last run that measured them (bench/results/full_scale.json, same
    shape), so a rerun of some steps keeps the others' figures in the report, which says where they came from."""
    path = RESULTS / "full_scale.json"
    last = json.loads(path.read_text()) if path.exists() else {}
    if last.get("shape") != shape:
        return {}
    out, carried = {}, dict(last.get("carried", {}))
    for step in sorted(skip & set(CARRIED_STEPS)):
        keys = [k for k in CARRIED_STEPS[step] if k in last]
        if keys:
            out |= {k: last[k] for k in keys}
            carried.setdefault(step, last.get("commit", "an earlier commit"))
    return {**out, "carried": carried} if carried else out


def full_report(report: dict, speed: list[dict], memory: list[dict]) -> list[str]:
    steps = [{"step": "GGUF file", "GiB": report["gguf_gib"]}]
    if "convert_s" in report:
        steps.append({"step": "convert --gguf", "seconds": report["convert_s"], **report["convert_memory"]})
        steps[-1]["GiB"] = report["converted_gib"]
    loads = (("load converted (last round)", report["rounds"][-1]["moe_jax"]), ("load GGUF", report.get("direct")))
    for name, side in loads:
        if side and "failed" in side:
            steps.append({"step": name, "failed": side["failed"]})
        elif side:
            steps.append({"step": name, "seconds": side["load_s"], "first token s": side["first_token_s"]})
            steps[-1] |= {"peak_rss_gib": side["peak_rss_gib"], "peak_anon_gib": side["peak_anon_gib"]}
    if "failed" in report.get("train", {}):
        steps.append({"step": "LoRA step 1 x 512", "failed": report["train"]["failed"]})
    elif "train" in report:
        train = report["train"]
        steps.append({"step": "LoRA step 1 x 512", "seconds": train["step_s"]})
        steps[-1] |= {k: train[k] for k in ("peak_rss_gib", "peak_anon_gib")}
    lines = report_header(f"Full scale: {report['shape']}, whole, Q4_0, on this machine")
    lines += [
        "One GGUF file for both engines, random weights written by bench/full_scale_gguf.py (its scales keep every",
        "layer's routing spread over the experts as text's is: the last table's `experts_used` is the share of each",
        "layer's experts that got a token, `busiest_over_mean` the busiest one's load over the mean). moe_jax samples",
        f"at temperature {TEMPERATURE}; llama-batched-bench feeds random ids. Decode: {PROMPT}-token prompts,",
        f"{NEW} new tokens a row; prefill: one prompt. Memory: peak resident (file pages included) and anonymous GiB",
        "of each step's own process, sampled from /proc.",
        "",
    ]
    if report.get("carried"):
        steps_from = ", ".join(f"{step} (commit {commit})" for step, commit in sorted(report["carried"].items()))
        lines += [f"Not rerun this time, from the last run that measured them: {steps_from}.", ""]
    lines += ["## Steps (memory: peak resident / anonymous GiB of the step's process)", "", *markdown_table(steps), ""]
    title = f"## Tokens/s, {len(report['rounds'])} rounds, {report['threads']} threads"
    lines += [title, "", *markdown_table(speed), ""]
    lines += ["## moe_jax's peak memory per case against what it holds; the routing's spread", ""]
    lines += [*markdown_table(memory), ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
