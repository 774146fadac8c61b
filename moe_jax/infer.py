"""Batch generation: `moe-jax infer --model DIR --prompts FILE --out FILE [--backend host] [--batch-size N]`.

How it works and why: docs/INTERNALS.md, moe_jax/infer.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import moe_jax
from host_kernels import MAX_THREADS, QUANTIZED
from moe_jax import bundled, distributed
from moe_jax.api import AUTO_DTYPE, DTYPE_CHOICES, DTYPE_HELP
from moe_jax.backends import BACKENDS
from moe_jax.backends.placements import check_device_experts_flag, read_device_experts
from moe_jax.cli import MODEL_HELP, add_expert_shards_argument, check_expert_shards, prog, run_cli
from moe_jax.distributed import World, this_process_shard
from moe_jax.errors import InputError
from moe_jax.formats.prompts import prompt_token_ids, read_jsonl
from moe_jax.generation import lockstep
from moe_jax.generation.anchor_cache import AnchorCache, anchor_token_ids
from moe_jax.generation.engine import EngineStats, GenerationEngine, Request
from moe_jax.generation.sampling import check_sampling
from moe_jax.generation.speculation import MAX_DRAFTS
from moe_jax.output_files import NewFile, check_writable_dir, create_new, write_text
from moe_jax.run_log import GenerationMonitor, RunLog

DEFAULT_ADAPTER = Path("runs") / "default" / "adapter"  # what `moe-jax train` writes, from where it ran


def parse_args(argv):
    p = argparse.ArgumentParser(prog=prog("infer"), description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument("--adapter", type=Path, help="LoRA adapter directory (PEFT format, or a train.py run)")
    p.add_argument("--prompts", type=Path, default=bundled.PROMPTS, help="JSONL prompts (default: the bundled ones)")
    p.add_argument(
        "-p", "--prompt", action="append", help="a prompt's text instead of --prompts (repeatable: several prompts)"
    )
    p.add_argument("--out", type=Path, help="JSONL output (default: print completions)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--metrics", type=Path, help="JSONL of the run's figures, one record per finished prompt")
    p.add_argument("--tensorboard", type=Path, help="directory for TensorBoard event files of the same figures")
    p.add_argument(
        "--backend", default="host", choices=list(BACKENDS), help="where the experts compute (default: host)"
    )
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--batch-size", type=int, default=8, help="KV-cache slots generating at once")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt at most (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        help="speculative decoding: up to this many prompt-lookup drafts a step, verified at once, as many as pay "
        f"on this machine (1-{MAX_DRAFTS}; default: 0, off; greedy outputs unchanged, sampled ones drawn from the "
        "same distribution)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument(
        "--too-long",
        choices=["reject", "truncate"],
        default="reject",
        help="a prompt that does not fit the context window with --max-new-tokens: skip it (reported "
        "with finish_reason 'too_long') or keep its last tokens",
    )
    p.add_argument("--anchor-cache-mb", type=float, default=0.0, help="host memory for the anchor cache (0: off)")
    p.add_argument("--anchor-token", action="append", default=[], help="token string that ends an anchor segment")
    p.add_argument("--host-threads", type=int, help="host expert engine threads (default: all cores)")
    add_expert_shards_argument(
        p, "a process of a multi-process run holds the whole model and generates its share of the prompts"
    )
    p.add_argument("--device-memory-mb", type=float, help="device memory for the KV cache and expert weights")
    p.add_argument(
        "--kv-fraction",
        help="share of --device-memory-mb for the KV cache (the rest holds experts), or 'auto': each wave of "
        "prompts gets the KV cache it needs and the experts the rest",
    )
    p.add_argument(
        "--wave-size",
        type=int,
        help="prompts per generation batch (default: all at once); the memory split can change between waves",
    )
    p.add_argument(
        "--device-experts",
        type=Path,
        help='--backend hybrid: JSON file {"layer": [expert ids]} naming the experts kept on the device',
    )
    p.add_argument("--profile", type=Path, help="probe profile for --backend auto (default: this machine's)")
    p.add_argument("--verify", action="store_true", help="check a converted model's expert checksums first")
    p.add_argument("--no-native", action="store_true", help="no native kernels or XLA FFI handlers (to compare)")
    p.add_argument(
        "--pipeline",
        type=int,
        metavar="N",
        help="micro-batches of the device/host pipeline (default: the plan's choice, off where jax runs on the CPU)",
    )
    p.add_argument(
        "--quant",
        choices=list(QUANTIZED),
        help="generate from quantized weights: int8 (a scale per output column) or int4 (a scale per group of 32 "
        "k-rows, as llama.cpp's Q4_0; int4-g64 / int4-g128: groups of 64 / 128; mxfp4: GPT-OSS's format, experts "
        "only): the host experts and, in "
        "generation's steps, the attention and head weights",
    )
    return p.parse_args(argv)


def check_settings(args):
    """Everything that can be checked without the model, checked before loading it."""
    check_sampling(args.temperature, args.top_p, args.top_k, args.seed)
    if any(not s for s in args.stop):
        raise InputError("--stop must not be empty (an empty string would stop every prompt before its first token)")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise InputError("--batch-size and --max-new-tokens must be >= 1")
    if not 0 <= args.draft_tokens <= MAX_DRAFTS:
        raise InputError(f"--draft-tokens must be in [0, {MAX_DRAFTS}], got {args.draft_tokens}")
    if args.host_threads is not None:
        if not 1 <= args.host_threads <= MAX_THREADS:
            raise InputError(f"--host-threads must be in [1, {MAX_THREADS}], got {args.host_threads}")
    if args.anchor_cache_mb < 0:
        raise InputError("--anchor-cache-mb must be >= 0")
    check_expert_shards(args.expert_shards)
    check_device_experts_flag(args.backend, args.device_experts)
    if args.wave_size is not None and args.wave_size < 1:
        raise InputError("--wave-size must be >= 1")
    if args.device_memory_mb is not None and not (math.isfinite(args.device_memory_mb) and args.device_memory_mb > 0):
        raise InputError(f"--device-memory-mb must be a finite number > 0, got {args.device_memory_mb}")
    if args.kv_fraction is not None:
        if args.device_memory_mb is None:
            raise InputError("--kv-fraction needs --device-memory-mb: the memory it is a share of")
        if args.kv_fraction != "auto":
            try:
                fraction = float(args.kv_fraction)
            except ValueError:
                raise InputError(
                    f"--kv-fraction must be a number in [0, 1] or 'auto', got {args.kv_fraction!r}"
                ) from None
            if not 0.0 <= fraction <= 1.0:  # (NaN fails this too)
                raise InputError(f"--kv-fraction must be in [0, 1], got {fraction}")


def load_prompts(args, model):
    """(line, token ids, text) per prompt, fitted to the context window; plus how many were cut or skipped."""
    window = model.config.max_position_embeddings - args.max_new_tokens
    if window < 1:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} leaves no room in the context window")
    prompts, truncated, rejected = [], 0, []
    if args.prompt:
        records = [(i + 1, {"prompt": text}) for i, text in enumerate(args.prompt)]
    else:
        records = read_jsonl(args.prompts)
    for number, record in records:
        where = f"-p #{number}: " if args.prompt else f"{args.prompts}:{number}: "
        ids, text = prompt_token_ids(record, model.tokenizer, where=where)
        if not ids:
            raise InputError(f"{where}empty prompt")
        try:
            model.check_token_ids([ids])
        except InputError as e:
            raise InputError(f"{where}{e}") from None
        if len(ids) > window:
            if args.too_long == "reject":
                rejected.append(number)
                continue
            ids, truncated = ids[-window:], truncated + 1
        prompts.append((number, ids, text))
    if not prompts and not rejected:
        raise InputError(f"{args.prompts}: no prompts")
    return prompts, truncated, rejected


def main(argv=None):
    args = parse_args(argv)
    check_settings(args)
    world = distributed.join()
    for flag, path in (("--out", args.out), ("--metrics", args.metrics)):  # unwritable: refused now, not at the end
        if path is not None:
            check_writable_dir(path.parent, f"{flag}'s directory")
            if path.is_dir():
                raise InputError(f"{flag} {path} is a directory; give a file path")
    if args.metrics is not None and args.out is not None and args.metrics.resolve() == args.out.resolve():
        raise InputError(f"--metrics and --out are the same file {args.out}")
    if args.model is None:  # the bundled default, with the adapter train.py wrote for it if there is one
        args.model = bundled.MODEL
        if args.adapter is None and DEFAULT_ADAPTER.exists():
            args.adapter = DEFAULT_ADAPTER
            print(f"using the adapter moe-jax train wrote: {DEFAULT_ADAPTER}", file=sys.stderr)
    budget = int(args.device_memory_mb * 2**20) if args.device_memory_mb else None
    fixed_fraction = float(args.kv_fraction) if args.kv_fraction not in (None, "auto") else None
    shard = this_process_shard(args.expert_shards)
    model = moe_jax.load_model(
        args.model,
        backend=args.backend,
        dtype=args.dtype,
        adapter=args.adapter,
        host_threads=args.host_threads,
        device_budget_bytes=budget,
        kv_fraction=fixed_fraction,
        profile=args.profile,
        verify=args.verify,
        native=False if args.no_native else None,
        quant=args.quant,
        device_experts=read_device_experts(args.device_experts) if args.device_experts else None,
        pipeline=args.pipeline,
        expert_shard=shard,
    )
    # expert parallel: process 0 generates every prompt, the others computing their experts' share of each step
    lockstep.run(model, lambda: generate_prompts(args, model, world if shard is None else World()))


def generate_prompts(args, model, world: World):
    """Generates for the prompts of `args` (`world`'s share of them) and writes their records."""
    from tqdm import tqdm

    tok = model.tokenizer
    prompts, truncated, rejected = load_prompts(args, model)
    cache = None
    if args.anchor_cache_mb > 0:
        cache = AnchorCache(anchor_token_ids(tok, args.anchor_token), budget_bytes=int(args.anchor_cache_mb * 2**20))
    requests = [Request(ids, args.max_new_tokens, args.seed + i) for i, (_, ids, _) in enumerate(prompts)]
    prompts, requests = world.share(prompts), world.share(requests)  # every prompt keeps its seed
    stop = None
    if args.stop and tok is not None:
        stop = lambda index, tokens: any(s in tok.decode(tokens) for s in args.stop)  # noqa: E731
    bar = tqdm(
        total=len(requests),
        desc="generating",
        unit="prompt",
        file=sys.stderr,
        disable=args.no_progress or not world.is_main,
    )
    stats, results = EngineStats(), []
    log = (
        RunLog(create_new(args.metrics) if args.metrics else None, args.tensorboard) if world.is_main else RunLog(None)
    )
    monitor = GenerationMonitor(model, log, cache)
    # each finished record is written at once (in finishing order) to a file of this run's own, so a failure
    # part-way keeps what was done as OUT.partial (OUT.partial.N: process N's); at the end the records are
    # written in input order to OUT
    partial = ".partial" + (f".{world.index}" if world.index else "")
    progress = NewFile(args.out.with_name(args.out.name + partial)) if args.out else None

    def finished(record):
        results.append(record)
        so_far = (
            stats.accepted_tokens + engine.stats.accepted_tokens,
            stats.drafted_tokens + engine.stats.drafted_tokens,
        )
        monitor.finish(record["completion_tokens"], so_far if args.draft_tokens else None)
        bar.update(1)
        if progress is not None:
            progress.write(json.dumps(record) + "\n")
            progress.flush()

    try:
        wave_size = args.wave_size or max(1, len(requests))
        for start in range(0, len(requests), wave_size):
            wave = requests[start : start + wave_size]
            longest = max(len(r.tokens) for r in wave)
            engine = GenerationEngine(
                model, args.batch_size, longest + args.max_new_tokens, cache, drafts=args.draft_tokens
            )
            if args.kv_fraction == "auto":
                fit_split_to_wave(model, engine, len(wave))
            engine.run(
                wave,
                args.temperature,
                args.top_p,
                args.top_k,
                eos_ids=() if args.no_eos else model.config.eos_token_ids,
                should_stop=stop,
                on_finish=lambda index, done, start=start: finished(
                    result_record(*prompts[start + index], done, tok, args.stop)
                ),
            )
            stats.add(engine.stats)
        bar.close()
        if world.several:
            results = [r for share in distributed.gather_objects(results) for r in share]
        results += [{"line": n, "finish_reason": "too_long", "completion": None} for n in rejected]
        results.sort(key=lambda r: r["line"])
        if world.is_main:
            write_results(args.out, results)
    except BaseException:
        if progress is not None:
            progress.keep_partial_as(progress.path)
            print(f"stopped: the {len(results)} finished record(s) are in {progress.path}", file=sys.stderr)
        raise
    finally:
        bar.close()
        monitor.close()
    if progress is not None:
        progress.discard()
    if world.is_main:
        print_summary(args, model, monitor.total.summary(), stats, cache, truncated, rejected, world)


def fit_split_to_wave(model, engine, prompts: int):
    """--kv-fraction auto: the KV cache gets what this wave's slots need, the experts everything else."""
    slots = min(engine.slots, prompts)
    room = model.device_budget_bytes - model.placement.stream_buffer_bytes
    model.set_memory_split(kv_bytes=min(slots * model.kv.bytes_per_sequence(engine.max_len), max(room, 0)))


def result_record(number, ids, text, completion, tok, stops) -> dict:
    decoded = tok.decode(completion.tokens) if tok is not None else None
    for s in stops:
        if decoded is not None and s in decoded:
            decoded = decoded.split(s)[0]
    return {
        "line": number,
        "prompt": text,
        "completion": decoded,
        "completion_ids": completion.tokens,
        "prompt_tokens": len(ids),
        "reused_prompt_tokens": completion.reused_tokens,
        "completion_tokens": len(completion.tokens),
        "finish_reason": completion.finish_reason,
        "seconds": completion.seconds,
    }


def write_results(out, results):
    if out:
        write_text(out, "".join(json.dumps(r) + "\n" for r in results))  # atomic; replaces a link at `out`
        return
    for r in results:
        print(f"{r.get('prompt')!r} -> {r['completion']!r}  [{r['finish_reason']}]")


def print_summary(args, model, metrics, st, cache, truncated, rejected, world):
    whose = f"{world.describe()}, " if world.several else ""
    lines = [
        f"{whose}backend={args.backend}: prefill {st.prefill_tokens / max(st.prefill_s, 1e-9):,.0f} tok/s, "
        f"decode {st.decode_tokens / max(st.decode_s, 1e-9):,.0f} tok/s (compilation included); host busy "
        f"{metrics['host_busy_s']:.2f}s, device waited {metrics['device_wait_s']:.2f}s, host "
        f"{metrics['host_gflops']:.1f} GFLOP/s",
        f"plan: {model.plan.summary()}",
    ]
    split = model.memory_split()
    if split["budget"] is not None:
        kv = "unlimited" if split["kv_budget"] is None else f"{split['kv_budget'] / 2**20:.1f} MiB"
        lines.append(
            f"device memory {split['budget'] / 2**20:.1f} MiB: KV cache {kv}, experts "
            f"{split['experts_in_use'] / 2**20:.1f} MiB in use"
        )
    if args.device_experts:
        lines.append(
            f"hybrid: {split['experts_in_use'] / 2**20:.1f} MiB of experts on the device ({args.device_experts})"
        )
    if args.draft_tokens:
        lines.append(
            f"speculative decoding: {st.accepted_tokens} of {st.drafted_tokens} drafts accepted"
            + ("" if st.drafted_tokens else " (drafting did not pay on this model here: plain steps ran)")
        )
    if truncated or rejected:
        lines.append(f"too long for the context window: {truncated} truncated, {len(rejected)} rejected")
    if cache is not None:
        c = cache.summary()
        lines.append(
            f"anchor cache: {c['prompt_tokens']} prompt tokens, {c['prefilled_tokens']} prefilled, {c['hits']} hits, "
            f"{c['bytes_held'] / 2**20:.1f} MiB held, {c['evictions']} evictions"
        )
    written = [str(path) for path in (args.out, args.metrics, args.tensorboard) if path]
    if written:
        lines.append(f"wrote {', '.join(written)}")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_cli(main))
