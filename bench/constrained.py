"""What holding the output to a JSON schema costs per token: llguidance (what moe_jax uses) against outlines-core,
and in the generation engine, constrained against free sampling.

    python bench/constrained.py [--vocab 32768] [--rounds 3]

1. The grammar engines alone, on a byte-level BPE vocabulary trained here on Python sources (`--vocab` tokens, as
   a real model's: the vocabulary size is what a step's mask is computed over): a tool-call-like schema's valid
   document, compact, tokenized and fed token by token; each step computes the whole mask as a bitmask and takes
   the token (checked to be allowed). Prints the one-time costs (the vocabulary, the schema's grammar or index)
   and the median step.
2. The engine: the bench model (its 4,096-token vocabulary as the same kind of BPE) decoding one sequence at
   temperature 1 with and without the schema's constraint, in turn for `--rounds` rounds (both read their logits
   on the host every step, so the difference is the constraint's).
Writes bench/results/constrained.json and bench/reports/constrained.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, short_commit, write_json, write_report  # noqa: E402
from bench.models import bench_model_dir  # noqa: E402
from moe_jax.doctor import cpu_model  # noqa: E402

CORPUS_BYTES = 24 << 20
SCHEMA = {  # an agent's tool call: nested objects, enums, bounded numbers, free strings and arrays
    "type": "object",
    "properties": {
        "tool": {"enum": ["read_file", "write_file", "run_tests", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer", "minimum": 1, "maximum": 100000},
                "query": {"type": "string"},
                "flags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "dry_run": {"type": "boolean"},
            },
            "required": ["path", "line", "query", "flags", "dry_run"],
            "additionalProperties": False,
        },
        "reason": {"type": "string"},
    },
    "required": ["tool", "arguments", "reason"],
    "additionalProperties": False,
}
DOCUMENT = {
    "tool": "search",
    "arguments": {
        "path": "moe_jax/generation/batch.py",
        "line": 214,
        "query": "def take_chosen(self, slot: int, s: _Slot, row: np.ndarray):",
        "flags": ["--case-sensitive", "--word", "-n"],
        "dry_run": False,
    },
    "reason": "Find where a constrained job's next token is chosen, to see what happens when the grammar ends.",
}


def trained_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` tokens trained on this Python's sources (kept in the temp directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(tempfile.gettempdir()) / f"moe_jax_bench_bpe_{vocab}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    files, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            f.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):  # (the stdlib's tests hold a few deliberately broken files)
            continue
        files.append(str(f))
        total += f.stat().st_size
        if total > CORPUS_BYTES:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    tokenizer.save(str(path))
    return tokenizer


def token_bytes(tokenizer) -> list[bytes]:
    """Each token's bytes (the byte-level alphabet undone)."""
    alphabet = _byte_level_alphabet()
    vocab = tokenizer.get_vocab()
    out = [b""] * tokenizer.get_vocab_size()
    for text, i in vocab.items():
        out[i] = bytes(alphabet[c] for c in text) if all(c in alphabet for c in text) else text.encode()
    return out


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character map, reversed."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = list(printable), 0
    codes = list(printable)
    for b in range(256):
        if b not in printable:
            codes.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(codes, chars, strict=True)}


def document_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":"))).ids


def llguidance_steps(tokenizer, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.numpy

    from moe_jax.generation.constraint import JSON_OPTIONS, LIMITS

    vocab = tokenizer.get_vocab_size()
    start = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=0)
    vocabulary_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=LIMITS)
    compile_s = time.perf_counter() - start
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = (mask[0, token // 32] >> (token % 32)) & 1
        ok = matcher.consume_token(token)
        steps.append(time.perf_counter() - start)
        if not (allowed and ok):
            raise RuntimeError(f"llguidance refused token {token} of the document: {matcher.get_error()}")
    return {"engine": "llguidance", "vocabulary_s": vocabulary_s, "schema_s": compile_s, **_step_stats(steps)}


def outlines_steps(tokenizer, tokens: list[int]) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    vocab_size = tokenizer.get_vocab_size()
    start = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes(tokenizer)):
        if i != 0 and b:
            by_bytes.setdefault(b, []).append(i)
    vocabulary = outlines_core.Vocabulary(0, by_bytes)
    vocabulary_s = time.perf_counter() - start
    start = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), vocabulary)
    compile_s = time.perf_counter() - start
    guide = outlines_core.Guide(index)
    mask = np.zeros((vocab_size + 31) // 32, np.int32)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        allowed = (mask[token // 32] >> (token % 32)) & 1
        guide.advance(token)
        steps.append(time.perf_counter() - start)
        if not allowed:
            raise RuntimeError(f"outlines-core refused token {token} of the document")
    return {"engine": "outlines-core", "vocabulary_s": vocabulary_s, "schema_s": compile_s, **_step_stats(steps)}


def _step_stats(steps: list[float]) -> dict:
    return {
        "tokens": len(steps),
        "step_median_us": 1e6 * statistics.median(steps),
        "step_p90_us": 1e6 * float(np.percentile(steps, 90)),
        "steps_total_ms": 1e3 * sum(steps),
    }


def bpe_model_dir() -> Path:
    """The bench model with a 4,096-token byte-level BPE (links to its files), whose tokens can write JSON."""
    source = bench_model_dir()
    directory = Path(tempfile.gettempdir()) / "moe_jax_bench_mixtral_bpe"
    directory.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json") and not (directory / f.name).exists():
            (directory / f.name).symlink_to(f)
    trained_tokenizer(4096).save(str(directory / "tokenizer.json"))
    return directory


def engine_rows(rounds: int, new_tokens: int) -> list[dict]:
    """The bench model with a 4,096-token BPE: tokens/s decoding one sequence at temperature 1, constrained and
    free, in turn."""
    from moe_jax import load_model
    from moe_jax.formats.tokenizer import Tokenizer
    from moe_jax.generation.batch import Job, Request, Sampling
    from moe_jax.generation.constraint import GrammarVocabulary, json_schema_grammar
    from moe_jax.generation.engine import GenerationEngine

    directory = bpe_model_dir()
    model = load_model(directory)
    vocabulary = GrammarVocabulary(Tokenizer(directory), model.config.vocab_size, [0])
    constraint = vocabulary.compile(json_schema_grammar(SCHEMA))
    engine = GenerationEngine(model, 1, 16 + new_tokens)
    prompt = list(range(100, 116))

    def tokens_per_s(constrained: bool, seed: int) -> float:
        done = []
        job = Job(
            Request(prompt, new_tokens, seed),
            Sampling(temperature=1.0),
            on_finish=done.append,
            constraint=constraint.copy() if constrained else None,
        )
        with engine.batch(1) as batch:
            start = time.perf_counter()
            batch.admit([job])
            while batch.active:
                batch.step()
            seconds = time.perf_counter() - start
        return len(done[0].tokens) / seconds  # (a constrained sequence may end early: its grammar complete)

    tokens_per_s(True, 0), tokens_per_s(False, 0)  # compiled, warm
    free, constrained = [], []
    for r in range(rounds):
        free.append(tokens_per_s(False, r))
        constrained.append(tokens_per_s(True, r))
    return [
        {
            "vocab": model.config.vocab_size,
            "free_tokens_per_s": statistics.median(free),
            "constrained_tokens_per_s": statistics.median(constrained),
            "constrained_vs_free": statistics.median(c / f for c, f in zip(constrained, free, strict=True)),
        }
    ]


def report(args, engines: list[dict], engine: list[dict]) -> Path:
    lines = [
        "# Constrained decoding: the cost per token",
        "",
        f"{datetime.date.today()}, commit {short_commit()}, CPU {cpu_model()}; "
        f"`python bench/constrained.py --vocab {args.vocab} --rounds {args.rounds}`.",
        "",
        f"## The grammar engines alone ({args.vocab}-token byte-level BPE, a {engines[0]['tokens']}-token document)",
        "",
        "| engine | vocabulary (once) | schema (once per request) | step median | step p90 |",
        "|---|---|---|---|---|",
        *(
            f"| {r['engine']} | {r['vocabulary_s'] * 1e3:.0f} ms | {r['schema_s'] * 1e3:.1f} ms "
            f"| {r['step_median_us']:.0f} us | {r['step_p90_us']:.0f} us |"
            for r in engines
        ),
        "",
        "## In the engine (bench model, batch 1, temperature 1)",
        "",
        "| vocab | free tokens/s | constrained tokens/s | constrained / free |",
        "|---|---|---|---|",
        *(
            f"| {r['vocab']} | {r['free_tokens_per_s']:.1f} | {r['constrained_tokens_per_s']:.1f} "
            f"| {r['constrained_vs_free']:.2f} |"
            for r in engine
        ),
        "",
    ]
    return write_report("constrained", lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary of the grammar engines' runs")
    parser.add_argument("--rounds", type=int, default=3, help="constrained and free engine runs, in turn")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = trained_tokenizer(args.vocab)
    tokens = document_tokens(tokenizer)
    engines = [llguidance_steps(tokenizer, tokens)]
    try:
        engines.append(outlines_steps(tokenizer, tokens))
    except ImportError:
        print("outlines-core is not installed (pip install -e '.[bench]'): llguidance alone")
    print_table("grammar engines, one schema document fed token by token", engines)
    engine = engine_rows(args.rounds, args.new_tokens)
    print_table("generation engine, batch 1, temperature 1", engine)
    write_json("constrained", {"engines": engines, "engine": engine, "args": vars(args)})
    report(args, engines, engine)


if __name__ == "__main__":
    main()
