"""ik_llama.cpp, the llama.cpp fork people pick for MoE models on CPUs, as sides of bench/vs_llamacpp.py: its
llama-batched-bench on the same GGUF files, with run-time repacking (`-rtr`), its fused MoE on (its default) and off
(`-no-fmoe`), its flash attention off (see VARIANTS).

Stock, its batched-bench feeds token 0 at every position of every sequence, so every row routes to the same experts
(which flatters it against any engine decoding text); built here with the one change that makes it feed random ids
as mainline's does. From the ik-llama-cpp-python sdist's sources (~10 minutes on 2 cores):

    pip download ik-llama-cpp-python==0.1.5 --no-binary :all: --no-deps -d /tmp/llsrc
    tar xzf /tmp/llsrc/ik_llama_cpp_python-0.1.5.tar.gz -C /tmp
    cd /tmp/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp
    sed -i 's/common_batch_add(batch, 0, /common_batch_add(batch, std::rand() % llama_n_vocab(model), /' \\
        examples/batched-bench/batched-bench.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j 2 --target llama-batched-bench

then `python bench/vs_llamacpp.py --llama-cpp DIR --ik-llama-cpp /tmp/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import batched_bench_command

RANDOM_IDS = "std::rand() % llama_n_vocab(model)"  # the patched batched-bench's token
SOURCE = Path("examples") / "batched-bench" / "batched-bench.cpp"
# without its flash attention: on 16 sequences of random ids it aborts (GGML_ASSERT(S > 0), iqk_fa_templates.h)
VARIANTS = {"ik_llama.cpp -rtr": ["-rtr", "-no-fa"], "ik_llama.cpp -rtr -no-fmoe": ["-rtr", "-no-fmoe", "-no-fa"]}
# its table's columns: PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s
S_PP, S_TG = 5, 7


def ik_batched_bench(directory: Path) -> Path:
    """The built, patched llama-batched-bench of an ik_llama.cpp tree; exits saying what is missing otherwise."""
    binary, source = directory / "build" / "bin" / "llama-batched-bench", directory / SOURCE
    if not binary.exists():
        sys.exit(f"{binary} is missing: build ik_llama.cpp as bench/ik_llama.py says")
    if RANDOM_IDS not in source.read_text():
        sys.exit(f"{source} feeds token 0 to every sequence (every row routes alike): patch it (bench/ik_llama.py)")
    if source.stat().st_mtime > binary.stat().st_mtime:
        sys.exit(f"{binary} is older than its patched source {source}: rebuild it")
    return binary


def ik_case(binary: Path, model: Path, threads: int, case: str, flags: list[str], prompt: int, new: int, prefill: int):
    """One run of one case (vs_llamacpp's "decode bN" / "prefill 1 x P") with `flags`: its tokens/s, S_TG for
    decode and S_PP for prefill, from the table it prints; None where it printed no row."""
    if case.startswith("prefill"):
        args, column = ["-npp", str(prefill), "-ntg", "1", "-npl", "1"], S_PP
    else:
        args, column = ["-npp", str(prompt), "-ntg", str(new), "-npl", case.removeprefix("decode b")], S_TG
    cmd = [*batched_bench_command(binary.resolve(), model.resolve(), threads), *flags, *args]
    # (it prints its table with its log, on stderr, and writes llama.log where it runs: in a scratch directory)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryDirectory() as scratch:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=out, check=True, cwd=scratch)
        out.seek(0)
        rows = [line.strip("|\n").split("|") for line in out if line.startswith("|")]
    values = [float(r[column]) for r in rows if len(r) > column and r[0].strip().isdigit()]
    return values[0] if values else None
