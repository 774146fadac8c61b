"""The HTTP server against offline generation, and the anchor cache over HTTP, on the bench model.

    python bench/serve.py [--quick] [--clients 1,16,64]

1. Throughput and latency: N concurrent streaming clients (asyncio, plain HTTP) each send 4 prompts, one after
   the other, of 32 random tokens for 64 new tokens (`ignore_eos`) to `python -m moe_jax.serve` (a child process,
   --max-batch 16); the same prompts go through the generation engine in this process (what infer.py runs, same
   slots and context), the two in turn for 5 rounds. Prints the median round's tokens/s of both and their ratio
   (with the rounds' lowest and highest ratio), and p50/p99 time to first token and inter-token latency as the
   clients saw them. Server and bench share this machine's cores: the clients' own work is in
   the server's numbers.
2. Request options over HTTP (the bench model with a byte-level BPE, 16 streaming clients, each variant in turn):
   per-request LoRA adapters (two rank-8 adapters served, requests rotating among them and none) against greedy
   decoding on a server without adapters, and a JSON schema's constrained decoding (an agent's tool call,
   temperature 1) against free sampling: tokens/s, inter-token latency and the ratio per round.
3. Agent traces over HTTP (bench/data/agent_trace.json sent as chat messages, thinking dropped each turn, old
   tool results trimmed): `cached_tokens` over prompt tokens after the first two turns, and whether the outputs
   equal those of a server without the anchor cache.

Writes bench/results/serve.json and bench/reports/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_traces import TRACE, chat_requests, write_chat_tokenizer  # noqa: E402
from bench.common import RESULTS, machine_info, markdown_table, print_table, report_header, write_report  # noqa: E402
from bench.constrained import SCHEMA, bpe_model_dir  # noqa: E402
from bench.models import bench_model_dir, random_adapter  # noqa: E402
from moe_jax import load_model  # noqa: E402
from moe_jax.generation.engine import GenerationEngine, Request  # noqa: E402
from moe_jax.serving.process import running_server  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, MAX_BATCH = 32, 64, 16
REQUESTS_PER_CLIENT = 4  # back to back: the batch's ramp up and down is a small part of the run
# server and offline runs in turn, per client count; the median pair is shown (single rounds moved 0.70-0.99)
ROUNDS = 5
FIRST_TURNS = 2  # the replay's cache coverage is counted after these (each turn is two requests)


def chat_model_dir() -> Path:
    """The bench model with a tokenizer and chat template for the agent traces' token ids (links to its files)."""
    source = bench_model_dir()
    directory = Path(tempfile.gettempdir()) / "moe_jax_bench_mixtral_chat"
    directory.mkdir(exist_ok=True)
    for f in source.iterdir():
        if not (directory / f.name).exists():
            (directory / f.name).symlink_to(f)
    write_chat_tokenizer(directory)
    return directory


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab, PROMPT_TOKENS).tolist() for _ in range(n)]


def offline_tokens_per_s(engine: GenerationEngine, prompts) -> float:
    start = time.perf_counter()
    done = engine.run([Request(p, NEW_TOKENS) for p in prompts])
    return sum(len(c.tokens) for c in done) / (time.perf_counter() - start)


async def stream_completion(connection, body: dict):
    """POSTs `body` to /v1/completions on an open keep-alive connection (reader, writer) and yields (arrival
    time, event) for each server-sent event: a minimal HTTP/1.1 client (chunked transfer decoded by hand), so
    that what is timed is the server, not a client library's parsing, which runs on the same cores."""
    reader, writer = connection
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}")
    while (await reader.readline()).strip():  # headers
        pass
    buffer = b""
    while size := int((await reader.readline()).strip(), 16):
        buffer += (await reader.readexactly(size + 2))[:-2]
        *events, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            payload = event.removeprefix(b"data: ")
            if payload.startswith(b"{"):
                yield now, json.loads(payload)
    await reader.readline()  # the empty line after the last chunk: the connection is ready for the next request


async def stream_clients(port: int, prompts, clients: int, options: Callable[[int], dict] | None = None) -> dict:
    """`clients` concurrent streaming clients share `prompts` (each takes the next one when done); `options(i)`:
    fields the i-th request sends besides (or instead of) greedy decoding's."""
    queue = list(enumerate(prompts))
    first_token, gaps, tokens = [], [], 0

    async def one_client():
        nonlocal tokens
        connection = await asyncio.open_connection("127.0.0.1", port)
        while queue:
            i, prompt = queue.pop()
            body = {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                **(options(i) if options else {}),
            }
            sent, last = time.perf_counter(), None
            async for now, chunk in stream_completion(connection, body):
                if chunk.get("usage"):
                    tokens += chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        first_token.append(now - sent)
                    else:
                        gaps.append(now - last)
                    last = now
        connection[1].close()

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1e3 * statistics.median(first_token),
        "ttft_p99_ms": 1e3 * float(np.percentile(first_token, 99)),
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
    }


def throughput_table(model_dir: Path, client_counts: list[int], log_dir: Path) -> list[dict]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_len = PROMPT_TOKENS + NEW_TOKENS
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        "bench",
        "--max-batch",
        str(MAX_BATCH),
        "--max-model-len",
        str(max_len),
        "--anchor-cache-mb",
        "0",
    ]
    model = load_model(model_dir)  # offline runs here while the server idles (its thread only polls a queue)
    rows = []
    with running_server(args, log_dir / "throughput.log") as server:
        for clients in client_counts:
            prompts = random_prompts(REQUESTS_PER_CLIENT * clients, vocab, seed=clients)
            engine = GenerationEngine(model, min(clients, MAX_BATCH), max_len)
            asyncio.run(stream_clients(server.port, prompts[:clients], clients))  # compiles this batch's shapes
            offline_tokens_per_s(engine, prompts)
            runs, offline = [], []
            for _ in range(ROUNDS):  # server and offline in turn: a drift of the machine's speed hits both
                runs.append(asyncio.run(stream_clients(server.port, prompts, clients)))
                offline.append(offline_tokens_per_s(engine, prompts))
            ratios = [r["tokens_per_s"] / o for r, o in zip(runs, offline, strict=True)]
            median = sorted(range(ROUNDS), key=lambda i: ratios[i])[ROUNDS // 2]
            rows.append(
                {
                    "clients": clients,
                    "requests": len(prompts),
                    **runs[median],
                    "offline_tokens_per_s": offline[median],
                    "server_vs_offline": ratios[median],
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
    return rows


def options_table(clients: int, rounds: int, log_dir: Path) -> list[dict]:
    """What a request's options cost per token over HTTP: `clients` streaming clients, each variant in turn for
    `rounds` rounds, against its reference in the same round (per-request adapters against plain greedy decoding
    on a server without adapters; a JSON schema's constrained decoding against free sampling)."""
    model_dir = bpe_model_dir()
    adapters_dir = Path(tempfile.mkdtemp(prefix="moe_jax_bench_adapters_"))
    modules = [
        f"{name}={random_adapter(model_dir, adapters_dir / name, seed, targets, 8)}"
        for name, seed, targets in (("a", 1, ("q_proj", "v_proj", "o_proj")), ("b", 2, ("attention",)))
    ]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(REQUESTS_PER_CLIENT * clients, vocab, seed=1)
    schema = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": SCHEMA}}
    variants = {  # name: (server, options, reference)
        "greedy": ("plain", None, None),
        "greedy, 2 adapters served": ("adapters", None, "greedy"),
        "adapters a / b / none mixed": ("adapters", lambda i: {"model": ("a", "b", "bench")[i % 3]}, "greedy"),
        "temperature 1": ("plain", lambda i: {"temperature": 1, "seed": i}, None),
        "json_schema, temperature 1": (
            "plain",
            lambda i: {"temperature": 1, "seed": i, "response_format": schema},
            "temperature 1",
        ),
    }
    base = ["--model", str(model_dir), "--served-model-name", "bench", "--max-batch", str(MAX_BATCH)]
    base += ["--max-model-len", str(PROMPT_TOKENS + NEW_TOKENS), "--anchor-cache-mb", "0"]
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with (
        running_server(base, log_dir / "options_plain.log") as plain,
        running_server([*base, "--lora-modules", *modules], log_dir / "options_adapters.log") as with_adapters,
    ):
        ports = {"plain": plain.port, "adapters": with_adapters.port}
        for round_ in range(rounds + 1):  # the first round compiles and warms: not counted
            for name, (server, options, _) in variants.items():
                result = asyncio.run(stream_clients(ports[server], prompts, clients, options))
                if round_:
                    runs[name].append(result)
    rows = []
    for name, (_, _, reference) in variants.items():
        row = {
            "request": name,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[name]),
            "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in runs[name]),
        }
        row.update(vs="", ratio="", ratio_min="", ratio_max="")  # (a reference: the columns stay empty)
        if reference is not None:
            ratios = [
                r["tokens_per_s"] / ref["tokens_per_s"] for r, ref in zip(runs[name], runs[reference], strict=True)
            ]
            row.update(vs=reference, ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        rows.append(row)
    return rows


def replay(url: str, conversation) -> list[dict]:
    from openai import OpenAI  # the test extra's client: only the replay needs it

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    out = []
    for edit, messages in conversation:
        answer = client.chat.completions.create(
            model="bench", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        out.append(
            {
                "edit": edit,
                "prompt_tokens": answer.usage.prompt_tokens,
                "cached_tokens": answer.usage.prompt_tokens_details.cached_tokens,
                "answer": answer.choices[0].message.content,
            }
        )
    return out


def trace_table(model_dir: Path, turns: int | None, log_dir: Path) -> list[dict]:
    trace = json.loads(TRACE.read_text())
    if turns:
        trace["turns"] = trace["turns"][:turns]
    rows = []
    for cache_mb in ("512", "0"):
        args = ["--model", str(model_dir), "--served-model-name", "bench", "--anchor-cache-mb", cache_mb]
        with running_server(args, log_dir / f"replay_{cache_mb}.log") as server:
            for scenario, trim in (("thinking dropped", False), ("+ old tool results trimmed", True)):
                rows.append(
                    {
                        "scenario": scenario,
                        "cache_mb": cache_mb,
                        "answers": replay(server.url, chat_requests(trace, trim)),
                    }
                )
    table = []
    for with_cache, without in zip(rows[:2], rows[2:], strict=True):
        later = with_cache["answers"][2 * FIRST_TURNS :]
        table.append(
            {
                "scenario": with_cache["scenario"],
                "requests": len(with_cache["answers"]),
                "prompt_tokens": sum(a["prompt_tokens"] for a in with_cache["answers"]),
                "cached_after_first_turns": sum(a["cached_tokens"] for a in later)
                / sum(a["prompt_tokens"] for a in later),
                "identical_outputs_without_cache": [a["answer"] for a in with_cache["answers"]]
                == [a["answer"] for a in without["answers"]],
            }
        )
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 clients, 6 trace turns")
    parser.add_argument("--clients", default="1,16,64", help="concurrent streaming clients, comma-separated")
    args = parser.parse_args()
    client_counts = [1, 16] if args.quick else [int(c) for c in args.clients.split(",")]
    model_dir = chat_model_dir()
    log_dir = Path(tempfile.mkdtemp(prefix="moe_jax_bench_serve_"))
    throughput = throughput_table(model_dir, client_counts, log_dir)
    print_table(
        f"server vs offline, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, --max-batch {MAX_BATCH}",
        throughput,
    )
    options = options_table(MAX_BATCH, 2 if args.quick else ROUNDS, log_dir)
    options_title = f"request options over HTTP, {MAX_BATCH} streaming clients, tokens/s against a reference"
    print_table(options_title, options)
    traces = trace_table(model_dir, 6 if args.quick else None, log_dir)
    print_table("agent traces over HTTP: cached_tokens / prompt tokens after the first turns", traces)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "serve.json"
    results = {"machine": machine_info(), "throughput": throughput, "options": options, "agent_traces": traces}
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out} (server logs in {log_dir})")
    lines = report_header("The server: throughput against offline generation, request options, agent traces")
    lines += [f"## Server vs offline ({PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens)", ""]
    lines += [*markdown_table(throughput), "", f"## {options_title[0].upper()}{options_title[1:]}", ""]
    lines += [*markdown_table(options), "", "## Agent traces: cached tokens after the first turns", ""]
    lines += [*markdown_table(traces), ""]
    write_report("serve", lines)


if __name__ == "__main__":
    main()
