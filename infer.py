"""Batch generation: `python infer.py --model DIR --prompts FILE --out FILE [--backend host] [--batch-size N]`.

With no arguments it runs the bundled default model (models/tiny-moe) on the bundled prompts
(data/default_prompts.jsonl) and prints the completions. Prompts are JSONL: {"prompt": text},
{"messages": [{"role": ..., "content": ...}, ...]} (rendered with the checkpoint's chat template) or
{"input_ids": [...]}. Output is JSONL: completion, token counts, finish reason, timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moe_jax.cli import run_cli

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = ROOT / "models" / "tiny-moe"
DEFAULT_PROMPTS = ROOT / "data" / "default_prompts.jsonl"
DEFAULT_ADAPTER = ROOT / "runs" / "default" / "adapter"  # written by `python train.py`


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python infer.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="Hugging Face or converted directory")
    p.add_argument("--adapter", type=Path, help="LoRA adapter directory (moe_jax or PEFT format)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL prompts")
    p.add_argument("--out", type=Path, help="JSONL output (default: print completions)")
    p.add_argument("--backend", default="host", choices=["device", "host", "offload", "hybrid"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--host-threads", type=int, help="host expert engine threads (default: all cores)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.adapter is None and args.model == DEFAULT_MODEL and DEFAULT_ADAPTER.exists():
        args.adapter = DEFAULT_ADAPTER
        print(f"using the adapter train.py wrote: {DEFAULT_ADAPTER}", file=sys.stderr)
    from moe_jax.errors import InputError
    from moe_jax.sampling import check_sampling

    # everything that can be checked without the model is checked before loading it
    check_sampling(args.temperature, args.top_p, args.top_k)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise InputError("--batch-size and --max-new-tokens must be >= 1")
    from moe_jax.prompts import read_jsonl

    records = list(read_jsonl(args.prompts))
    if not records:
        raise InputError(f"{args.prompts}: no prompts")

    from tqdm import tqdm

    import moe_jax
    from moe_jax.generate import generate_tokens
    from moe_jax.prompts import prompt_token_ids

    model = moe_jax.load_model(
        args.model, backend=args.backend, dtype=args.dtype, adapter=args.adapter, host_threads=args.host_threads
    )
    tok = model.tokenizer
    prompts = []
    for number, record in records:
        ids, text = prompt_token_ids(record, tok, where=f"{args.prompts}:{number}: ")
        if not ids:
            raise InputError(f"{args.prompts}:{number}: empty prompt")
        try:
            model.check_token_ids([ids])
        except InputError as e:
            raise InputError(f"{args.prompts}:{number}: {e}") from None
        prompts.append((number, record, ids, text))

    stop_matcher = None
    if args.stop and tok is not None:
        stop_matcher = lambda row, tokens: any(s in tok.decode(tokens) for s in args.stop)  # noqa: E731

    timings: dict = {}
    results = []
    for start in tqdm(range(0, len(prompts), args.batch_size), desc="generating", unit="batch", file=sys.stderr):
        batch = prompts[start : start + args.batch_size]
        t0 = time.perf_counter()
        completions = generate_tokens(
            model,
            [p[2] for p in batch],
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            args.seed + start,
            top_k=args.top_k,
            should_stop=stop_matcher,
            timings=timings,
        )
        elapsed = time.perf_counter() - t0
        for (number, _record, ids, text), c in zip(batch, completions, strict=True):
            completion = tok.decode(c.tokens) if tok is not None else None
            if completion is not None:
                for s in args.stop:
                    completion = completion.split(s)[0] if s in completion else completion
            results.append(
                {
                    "line": number,
                    "prompt": text,
                    "completion": completion,
                    "completion_ids": c.tokens,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(c.tokens),
                    "finish_reason": c.finish_reason,
                    "batch_seconds": elapsed,
                }
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    else:
        for r in results:
            print(f"{r['prompt']!r} -> {r['completion']!r}  [{r['finish_reason']}]")
    metrics = model.metrics().summary()
    prefill = timings.get("prefill_tokens", 0) / max(timings.get("prefill_s", 0), 1e-9)
    decode = timings.get("decode_tokens", 0) / max(timings.get("decode_s", 0), 1e-9)
    print(
        f"{len(results)} prompts, backend={args.backend}: prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s "
        "(first batch includes compilation); "
        f"host busy {metrics['host_busy_s']:.2f}s, device waited {metrics['device_wait_s']:.2f}s, "
        f"host {metrics['host_gflops']:.1f} GFLOP/s",
        file=sys.stderr,
    )
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_cli(main))
