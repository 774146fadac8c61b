"""Hostile-input audit of the CLIs: malformed checkpoints, configs, stores, adapters, data, prompts and flags,
template code, kills, full and read-only disks, damaged GGUF files. Each case runs the real command in a
subprocess on a copy of the bundled model (or a tiny GGUF file) and is judged by what a user would see:

  clean   a non-zero exit with a one-line `error:` message (or, where the input is fine, a zero exit)
  CRASH   death by a signal;  TRACEBACK  a Python traceback;  ACCEPTED  a bad input that exited 0;
  REFUSED a good input refused;  and whatever a case's own check finds (a file deleted, a template's command run).

    python scripts/audit_hostile_inputs.py [--out audit.json] [--only SUBSTRING]

Full and read-only disks need `mount` (root); those cases are skipped, saying so, where it is not allowed.
Direct calls into the native code are covered by tests/test_native_checks.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hostile_cases import ROOT, adapter_cases, checkpoint_cases, config_cases, store_cases, template_cases
from hostile_run_cases import data_cases, disk_cases, flag_cases, gguf_cases, kill_cases


def judge(argv, expect_ok, check, work) -> tuple[str, str]:
    detail = ""
    if argv is not None:
        result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
        stderr = result.stderr.strip()
        last = stderr.splitlines()[-1] if stderr else ""
        detail = last[:200]
        if result.returncode < 0:
            return "CRASH", f"killed by signal {-result.returncode}"
        if "Traceback (most recent call last)" in stderr:
            return "TRACEBACK", last[:200]
        if expect_ok and result.returncode != 0:
            return "REFUSED", detail
        if not expect_ok and result.returncode == 0:
            return "ACCEPTED", "exit 0 on a bad input"
    else:
        result = None
    problem = check(work, result) if check else ""
    return ("PROBLEM", problem) if problem else ("clean", detail)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON report")
    p.add_argument("--only", help="run the cases whose category or name contains this")
    args = p.parse_args(argv)
    groups = (checkpoint_cases, config_cases, template_cases, store_cases, adapter_cases, data_cases, flag_cases,
              kill_cases, disk_cases, gguf_cases)  # fmt: skip
    report = []
    for case in (c for group in groups for c in group()):
        if args.only and args.only not in f"{case.category} {case.name}":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            start = time.perf_counter()
            try:
                argv_, expect_ok, check = case.run(work)
                if argv_ == "skip":
                    verdict, detail = "skipped", expect_ok
                else:
                    verdict, detail = judge(argv_, expect_ok, check, work)
            finally:
                if (work / "disk").is_mount():
                    subprocess.run(["umount", "--lazy", str(work / "disk")], capture_output=True)
        report.append({"category": case.category, "case": case.name, "verdict": verdict, "detail": detail,
                       "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
        print(f"{verdict:9s} {case.category:10s} {case.name:40s} {detail}", flush=True)
    bad = [r for r in report if r["verdict"] not in ("clean", "skipped")]
    print(f"\n{len(report)} cases: {len(report) - len(bad)} clean or skipped, {len(bad)} not")
    if args.out:
        args.out.write_text(json.dumps({"cases": report, "not_clean": len(bad)}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
