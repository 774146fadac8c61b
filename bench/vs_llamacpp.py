"""moe_jax against llama.cpp on the same model, side by side in one run.

    python bench/vs_llamacpp.py --llama-cpp DIR [--shape bench|qwen3-30b-a3b] [--pairs f32,bf16,int8,int4] [--rounds 5]
    python bench/vs_llamacpp.py --llama-cpp DIR --shape gpt-oss-20b --pairs mxfp4
    python bench/vs_llamacpp.py --llama-cpp DIR --ik-llama-cpp IK_DIR ...  # with ik_llama.cpp (bench/ik_llama.py)

DIR (or $LLAMA_CPP_DIR) is a llama.cpp source tree with its tools built. llama.cpp is not a dependency of this
project; to build one here (~10 minutes on 2 cores), from the sources the llama-cpp-python sdist carries:

    pip download llama-cpp-python --no-binary :all: --no-deps -d /tmp/llsrc
    tar xzf /tmp/llsrc/llama_cpp_python-*.tar.gz -C /tmp && cd /tmp/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j 2 --target llama-batched-bench llama-quantize
    pip install sentencepiece  # this script writes the small tokenizer llama.cpp's converter wants

The bench checkpoint (bench/models.py) is converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (f32, bf16,
q8_0; q4_0 with llama-quantize), in a directory beside it with a small sentencepiece tokenizer added (the converter
needs one; it pads the vocab; for Qwen MoE it is told to read that one too, see CONVERT). Each pair (moe_jax
float32 / llama.cpp f32, bfloat16 / bf16, int8 / Q8_0, int4 / Q4_0, and for GPT-OSS mxfp4: the checkpoint laid out
as OpenAI ships it, its experts MXFP4 blocks, which both sides keep as they are, the rest bfloat16) runs the same
cases with the same threads, each case back to back, A B in one round and B A in the next, over `--rounds`: decode
of 32-token prompts, 64 new tokens, at batch 1 and 16 (decode tokens/s: llama-batched-bench's S_TG, moe_jax's
decode steps), and the prefill of one 512-token prompt. Both sides decode tokens that route as text does:
llama-batched-bench feeds a random id each step, moe_jax samples at temperature 1 (greedy decoding of a random-weight
model cycles among a few tokens whose experts stay in cache, which would flatter moe_jax). Each side's median
tokens/s, and moe_jax / llama.cpp as the median of the rounds' own ratios (a round's two runs of a case saw the same
stretch of a noisy machine) with the lowest round's beside it; writes
bench/results/vs_llamacpp[-SHAPE].json.

As on an older CPU, from this one: MOE_JAX_HIDE_CPU_FLAGS hides CPU flags from moe_jax's kernel choice (by prefix),
XLA_FLAGS=--xla_cpu_max_isa=AVX2 holds XLA's own code to AVX2 (not every library it calls: its YNNPACK dots may
still use AVX-512), and llama.cpp is built for that CPU's instructions only. An AVX2-only one (AMD Zen 3):

    cmake -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build-avx2 -j 2 --target ...  # as above
    # a tree whose build/ is that build: a directory of links to the sources' files, build -> build-avx2
    MOE_JAX_HIDE_CPU_FLAGS=amx,avx512,avx_vnni XLA_FLAGS=--xla_cpu_max_isa=AVX2 python bench/vs_llamacpp.py ...

With only AMX hidden (MOE_JAX_HIDE_CPU_FLAGS=amx) moe_jax runs its AVX512-BF16 / VNNI kernels as on AMD Zen 4/5,
against a native llama.cpp build with `--no-repack` (llama.cpp's too: its AMX buffers off).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from bench.common import (  # noqa: E402
    batched_bench_command,
    comma_choices,
    machine_info,
    markdown_table,
    print_table,
    report_header,
    write_json,
    write_report,
)
from bench.ik_llama import VARIANTS, ik_batched_bench, ik_case  # noqa: E402
from bench.infer import NEW, PREFILL, PROMPT, engine_runner  # noqa: E402
from bench.models import add_shape_argument, bench_model_dir, mxfp4_release_dir, use_shape  # noqa: E402
from host_kernels import default_threads  # noqa: E402
from moe_jax.errors import MemoryLimitError  # noqa: E402

BATCHES = (1, 16)
CASES = [*(f"decode b{b}" for b in BATCHES), f"prefill 1 x {PREFILL}"]
SAMPLED = 1.0  # moe_jax's decode temperature (see above)


class Pair(NamedTuple):
    settings: dict  # moe_jax's load_model settings
    gguf_type: str  # llama.cpp's
    mxfp4_release: bool = False  # both read the MXFP4 release of the (GPT-OSS) checkpoint (bench.models)


PAIRS = {
    "f32": Pair({"dtype": "float32"}, "f32"),
    "bf16": Pair({"dtype": "bfloat16"}, "bf16"),
    "int8": Pair({"dtype": "bfloat16", "quant": "int8"}, "q8_0"),
    "int4": Pair({"dtype": "bfloat16", "quant": "int4"}, "q4_0"),
    # experts as shipped (moe_jax's default quant for such a checkpoint), the rest bfloat16 on both sides
    "mxfp4": Pair({"dtype": "bfloat16"}, "bf16", mxfp4_release=True),
}
DEFAULT_PAIRS = ("f32", "bf16", "int8", "int4")


def llama_tools(directory: Path) -> dict[str, Path]:
    tools = {
        "convert": directory / "convert_hf_to_gguf.py",
        "batched_bench": directory / "build" / "bin" / "llama-batched-bench",
        "quantize": directory / "build" / "bin" / "llama-quantize",
    }
    missing = [str(path) for path in tools.values() if not path.exists()]
    if missing:
        sys.exit(f"not a built llama.cpp tree ({', '.join(missing)} missing); see `python {__file__} --help`")
    return tools


def with_tokenizer(checkpoint: Path) -> Path:
    """A directory beside the checkpoint with its files linked and a small sentencepiece tokenizer.model added."""
    import sentencepiece

    target = checkpoint.with_name(checkpoint.name + "_gguf_source")
    target.mkdir(exist_ok=True)
    for path in checkpoint.iterdir():
        if path.suffix in (".json", ".safetensors") and not path.name.startswith("tokenizer"):
            link = target / path.name
            if not link.exists():
                link.symlink_to(path)
    if not (target / "tokenizer.model").exists():
        rng = np.random.default_rng(0)
        text = target / "text.txt"
        words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(3000)]
        text.write_text("\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)))
        sentencepiece.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(target / "tokenizer"), vocab_size=200, model_type="bpe"
        )
    return target


def gguf(tools, source: Path, kind: str) -> Path:
    """The checkpoint as a GGUF of `kind` (f32 / bf16 / q8_0 by the converter, q4_0 by llama-quantize), made once."""
    path = source / f"model-{kind}.gguf"
    if path.exists():
        return path
    if kind == "q4_0":
        subprocess.run([str(tools["quantize"]), str(gguf(tools, source, "f32")), str(path), "q4_0"], check=True)
    else:
        convert_with_llama_cpp(tools["convert"], source, kind, path)
    return path


# checkpoints saved by transformers hold no multi-token-prediction weights, which llama.cpp's converter requires of
# these families unless told there are none
WITHOUT_MTP = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def convert_with_llama_cpp(converter: Path, source: Path, kind: str, out: Path, quiet: bool = False):
    """llama.cpp's convert_hf_to_gguf.py (`converter`) on a checkpoint directory with a sentencepiece tokenizer
    (with_tokenizer's), writing `out` of GGUF type `kind`."""
    args = [str(source), "--outtype", kind, "--outfile", str(out)]
    if json.loads((source / "config.json").read_text()).get("model_type") in WITHOUT_MTP:
        args.append("--no-mtp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(converter.parent / d) for d in ("", "gguf-py"))}
    subprocess.run([sys.executable, "-c", CONVERT, str(converter), *args], check=True, env=env, capture_output=quiet)


# llama.cpp's converter, run with one change: the model classes that want a Hugging Face BPE tokenizer (known to it
# by hash) take the vocabulary from tokenizer.model instead, as its Llama classes do. Only the vocabulary's
# metadata differs; the weights and the compute graph are the converter's own.
CONVERT = """
import runpy, sys
from conversion import base, deepseek, glm, qwen
base.TextModel._set_vocab_gpt2 = base.TextModel._set_vocab_sentencepiece
for cls in (qwen.Qwen2MoeModel, qwen.Qwen3MoeModel, glm.Glm4MoeModel, deepseek.DeepseekV32Model):
    cls.set_vocab = lambda self: self._set_vocab_sentencepiece()
script = sys.argv.pop(1)
runpy.run_path(script, run_name="__main__")
"""


NO_REPACK: set[Path] = set()  # GGUF files llama.cpp runs with --no-repack (its repacked kernels crashed on them)


def llama_case(tools, model: Path, threads: int, case: str) -> float | None:
    """One llama-batched-bench run of one case (CASES): its tokens/s, decode's S_TG or prefill's S_PP; None where
    it printed no result twice (now and then a run prints none: the case is then left out of this round)."""

    def run(*args) -> list[dict]:
        cmd = [*batched_bench_command(tools["batched_bench"], model, threads), "--output-format", "jsonl", *args]
        if model in NO_REPACK:
            cmd.append("--no-repack")
        with tempfile.TemporaryFile("w+") as out:  # (its results did not reach a pipe here, only a file)
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.DEVNULL)
            if done.returncode < 0 and model not in NO_REPACK:
                # killed by a signal: llama.cpp 0.3.36's weights repacked for AMX (Q8_0 on a Sapphire Rapids)
                # crash; its plain CPU kernels are what runs then, and the table says so
                print(f"llama.cpp died ({signal.Signals(-done.returncode).name}) on {model.name}: again with "
                      "--no-repack", file=sys.stderr)  # fmt: skip
                NO_REPACK.add(model)
                return run(*args)
            done.check_returncode()
            out.seek(0)
            return [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]

    if case.startswith("prefill"):
        args, speed = ("-npp", str(PREFILL), "-ntg", "1", "-npl", "1"), "speed_pp"
    else:
        args, speed = ("-npp", str(PROMPT), "-ntg", str(NEW), "-npl", case.removeprefix("decode b")), "speed_tg"
    results = run(*args) or run(*args)
    return results[0][speed] if results else None


def moe_jax_runners(checkpoint: Path, settings: dict, threads: int) -> dict:
    model = moe_jax.load_model(checkpoint, backend="host", host_threads=threads, **settings)
    runners = {f"decode b{b}": engine_runner(model, b, NEW, temperature=SAMPLED) for b in BATCHES}
    runners[f"prefill 1 x {PREFILL}"] = engine_runner(model, 1, 0, PREFILL)
    return runners


def moe_jax_case(runner, case: str) -> float:
    return runner()["prefill_tok_s" if case.startswith("prefill") else "decode_tok_s"]


def round_ratios(rounds: dict[str, list[dict]], engine: str = "llama.cpp") -> dict[str, list[float]]:
    """Per case, moe_jax / `engine` of each round: the two ran back to back, so each ratio saw one stretch of the
    machine (whose memory speed moves by up to 1.5x from minute to minute here), which the ratio of the two sides'
    medians would not (rounds where the engine printed no result for a case are left out of that case)."""
    ratios: dict[str, list[float]] = {}
    for llama, ours in zip(rounds[engine], rounds["moe_jax"], strict=True):
        for case, value in ours.items():
            if case in llama:
                ratios.setdefault(case, []).append(value / llama[case])
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"), help="llama.cpp tree")
    parser.add_argument("--pairs", default=",".join(DEFAULT_PAIRS), help=f"comma-separated, from {', '.join(PAIRS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--no-repack", action="store_true", help="llama.cpp without repacked weights (no AMX)")
    parser.add_argument(
        "--ik-llama-cpp",
        type=Path,
        default=os.environ.get("IK_LLAMA_CPP_DIR"),
        help="an ik_llama.cpp tree (bench/ik_llama.py: how to build it): its -rtr runs, fused MoE on and off, as sides",
    )
    add_shape_argument(parser)
    args = parser.parse_args()
    use_shape(args.shape)
    if args.llama_cpp is None:
        parser.error("give --llama-cpp DIR or set LLAMA_CPP_DIR (how to build one: --help)")
    pairs = comma_choices(parser, args.pairs, PAIRS, "--pairs")
    if "mxfp4" in pairs and not args.shape.startswith("gpt-oss"):
        parser.error("the mxfp4 pair reads a GPT-OSS release: give --shape gpt-oss-20b")
    tools = llama_tools(args.llama_cpp)
    ik = ik_batched_bench(args.ik_llama_cpp) if args.ik_llama_cpp else None
    print(machine_info())
    rows, raw = [], {}
    for pair in pairs:
        settings, kind, release = PAIRS[pair]
        checkpoint = mxfp4_release_dir() if release else bench_model_dir()
        model_file = gguf(tools, with_tokenizer(checkpoint), kind)
        if args.no_repack:
            NO_REPACK.add(model_file)
        try:
            runners = moe_jax_runners(checkpoint, settings, args.threads) if settings else None
        except MemoryLimitError as e:  # the other pairs still run; the table says why this one is missing
            rows.append({"pair": pair, "side": f"moe_jax: not run ({e})"})
            runners = None
        engines = ["llama.cpp", *(VARIANTS if ik else ())]
        rounds = {side: [] for side in [*engines, *(["moe_jax"] if runners else [])]}
        for i in range(args.rounds):
            results = {side: {} for side in rounds}
            for case in CASES:
                # each case A B, then B A the next round: the two runs a few seconds apart see the same stretch of
                # a noisy machine, and neither always goes first
                sides = [("llama.cpp", partial(llama_case, tools, model_file, args.threads, case))]
                for variant, flags in VARIANTS.items() if ik else ():
                    run_ik = partial(ik_case, ik, model_file, args.threads, case, flags, PROMPT, NEW, PREFILL)
                    sides.append((variant, run_ik))
                if runners:
                    sides.append(("moe_jax", partial(moe_jax_case, runners[case], case)))
                for side, run in sides if i % 2 == 0 else sides[::-1]:
                    if (value := run()) is not None:
                        results[side][case] = value
            for side, values in results.items():  # (a dict each round, empty or not: rounds pair up by position)
                rounds[side].append(values)
        raw[pair] = rounds
        for side, results in rounds.items():
            if any(results):
                # a llama-batched-bench run now and then leaves a case out of its output: the others' median
                cases = dict.fromkeys(case for r in results for case in r)
                median = {case: float(np.median([r[case] for r in results if case in r])) for case in cases}
                llama = f"{side} {'MXFP4 experts, ' if release else ''}{kind}"
                llama += " --no-repack" if model_file in NO_REPACK and side == "llama.cpp" else ""
                rows.append({"pair": pair, "side": side if side == "moe_jax" else llama, **median})
        for engine in engines if runners else ():
            ratios = round_ratios(rounds, engine)
            medians = {case: float(np.median(r)) for case, r in ratios.items()}
            rows.append({"pair": pair, "side": f"moe_jax / {engine}"} | medians)
            rows.append({"pair": pair, "side": "  lowest round"} | {c: min(r) for c, r in ratios.items()})
        print_table(f"{pair}, tokens/s (medians of {args.rounds} rounds)", [r for r in rows if r["pair"] == pair])
        del runners  # and their model, before the next pair loads its own (on Qwen3's dims float32 holds ~11 GB)
        gc.collect()
    print_table(f"tokens/s, {args.threads} threads, shape {args.shape}: decode (32-token prompts) and prefill", rows)
    name = "vs_llamacpp" if args.shape == "bench" else f"vs_llamacpp-{args.shape}"
    write_json(name, {"shape": args.shape, "threads": args.threads, "rows": rows, "raw": raw})
    title = f"moe_jax against llama.cpp, {args.shape} shape, {args.threads} threads: tokens/s and their ratio"
    routing = (
        "Tokens route as text does on every side: llama-batched-bench feeds random ids (ik_llama.cpp's patched to, "
        f"bench/ik_llama.py), moe_jax samples at temperature {SAMPLED}."
    )
    write_report(name, [*report_header(title), routing, "", *markdown_table(rows), ""])


if __name__ == "__main__":
    main()
