"""An OpenAI- and Anthropic-compatible HTTP server: `python -m moe_jax.serve --model DIR [--port 8000]`.

How it works and why: docs/INTERNALS.md, moe_jax/serve.py.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

import uvicorn

import moe_jax
from host_kernels import MAX_THREADS, QUANTIZED
from moe_jax import bundled, distributed
from moe_jax.api import AUTO_DTYPE, DTYPE_CHOICES, DTYPE_HELP
from moe_jax.backends import BACKENDS
from moe_jax.cli import MODEL_HELP, add_expert_shards_argument, check_expert_shards, prog, run_cli
from moe_jax.distributed import this_process_shard
from moe_jax.errors import InputError, MemoryLimitError
from moe_jax.formats.hub import hub_id
from moe_jax.generation import lockstep
from moe_jax.generation.speculation import MAX_DRAFTS
from moe_jax.serving.app import create_app
from moe_jax.serving.http_limits import HttpLimits, bounded_protocol
from moe_jax.serving.service import Limits, Service

GIL_SWITCH_INTERVAL_S = 0.0005
SHUTDOWN_MARGIN_S = 5


def parse_args(argv):
    p = argparse.ArgumentParser(prog=prog("serve"), description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument(
        "--adapter", type=Path, help="LoRA adapter directory (PEFT format, or a train run) under every request"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters a request chooses by name (model: NAME, or <model>:NAME, or an adapter field), "
        "batched together: attention and MLP targets",
    )
    p.add_argument(
        "--backend", default="host", choices=list(BACKENDS), help="where the experts compute (default: host)"
    )
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--quant", choices=list(QUANTIZED), help="serve from quantized host experts (as infer.py)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences generating at once (KV-cache slots)")
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        help="speculative decoding: up to this many prompt-lookup drafts a step, as many as pay (1-"
        f"{MAX_DRAFTS}; default: 0, off; greedy answers unchanged, sampled ones distributed as without)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 429s")
    p.add_argument("--max-model-len", type=int, help="context per sequence (default: the model's)")
    p.add_argument("--anchor-cache-mb", type=float, default=512.0, help="host memory for the anchor cache (0: off)")
    p.add_argument("--served-model-name", help="the model name clients ask for (default: the directory's name)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require a key on every request but /health (repeat for several clients: each key's requests see only "
        "their own prefix cache entries)",
    )
    p.add_argument("--max-request-mb", type=float, default=16.0, help="the largest request body (413 past it)")
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        help="the longest prompt text, refused before tokenizing (default: the context times the longest token)",
    )
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds to send a request head, and its body")
    p.add_argument("--max-header-kb", type=float, default=64.0, help="the largest request head: line and headers")
    p.add_argument("--max-headers", type=int, default=100, help="the most header lines a request may have")
    p.add_argument("--host-threads", type=int, help="host expert engine threads (default: all cores)")
    add_expert_shards_argument(p, "one process serves the whole model")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get at shutdown")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default: info)",
    )
    return p.parse_args(argv)


def check_settings(args):
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_batch < 1 or args.max_queue < 0:
        raise InputError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise InputError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if not 0 <= args.draft_tokens <= MAX_DRAFTS:
        raise InputError(f"--draft-tokens must be in [0, {MAX_DRAFTS}], got {args.draft_tokens}")
    if args.anchor_cache_mb < 0 or args.shutdown_timeout < 0:
        raise InputError("--anchor-cache-mb and --shutdown-timeout must be >= 0")
    if args.host_threads is not None and not 1 <= args.host_threads <= MAX_THREADS:
        raise InputError(f"--host-threads must be in [1, {MAX_THREADS}], got {args.host_threads}")
    if any(not key for key in args.api_key):
        raise InputError("--api-key must not be empty")
    if args.max_request_mb <= 0 or args.request_timeout <= 0 or args.max_header_kb <= 0 or args.max_headers < 1:
        raise InputError("--max-request-mb, --request-timeout, --max-header-kb and --max-headers must be positive")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise InputError(f"--max-prompt-chars must be >= 1, got {args.max_prompt_chars}")
    check_expert_shards(args.expert_shards)


def lora_modules(given: list[str]) -> dict[str, Path]:
    """{name: directory} of --lora-modules NAME=PATH ..."""
    named = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in named:
            raise InputError(f"--lora-modules names {name!r} twice")
        named[name] = Path(path)
    return named


def served_name(model) -> str:
    """What clients call the model by default: its Hub id as given, else its directory's (or file's) name."""
    return str(model) if hub_id(model) is not None else Path(model).resolve().name


def main(argv=None):
    args = parse_args(argv)
    check_settings(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    world = distributed.join()
    if world.several and args.expert_shards == 1:
        raise InputError(
            f"a server over {world.count} processes holds its experts in shards: give --expert-shards {world.count}"
        )
    model_dir = args.model or bundled.MODEL
    model = moe_jax.load_model(
        model_dir,
        backend=args.backend,
        dtype=args.dtype,
        adapter=args.adapter,
        adapters=lora_modules(args.lora_modules),
        host_threads=args.host_threads,
        quant=args.quant,
        expert_shard=this_process_shard(args.expert_shards),
    )
    # expert parallel: process 0 serves, the others compute their experts' share of each of its steps
    lockstep.run(model, lambda: serve(args, model, model_dir))


def serve(args, model, model_dir):
    """Serves `model` over HTTP until the server is stopped."""
    limits = Limits(
        args.max_batch,
        args.max_queue,
        args.max_model_len,
        int(args.anchor_cache_mb * 2**20),
        args.max_prompt_chars,
        args.draft_tokens,
    )
    service = Service(model, args.served_model_name or served_name(model_dir), limits)
    try:
        service.start()  # compiles before the port opens: the first request does not wait for it
    except MemoryLimitError as e:
        raise MemoryLimitError(
            f"{e}. The server's KV cache holds --max-batch sequences of --max-model-len tokens (here "
            f"{service.scheduler.slots} x {service.context}): give a smaller --max-model-len or --max-batch"
        ) from None
    # the model, JAX and the web stack are long-lived: keep the cycle collector from walking them again and
    # again between decode steps (what remains is each request's own objects)
    gc.collect()
    gc.freeze()
    # the engine thread waits on the device and needs the interpreter back at once when a step ends, while the
    # event loop thread streams tokens: a switch interval a tenth of Python's default
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    print(
        f"serving {service.name!r} ({model.backend} backend{shard_note(model)}, {service.scheduler.slots} slots of "
        f"{service.context} "
        f"tokens{', adapters ' + ', '.join(model.served_adapters) if model.served_adapters else ''}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    http_limits = HttpLimits(
        int(args.max_request_mb * 2**20), int(args.max_header_kb * 2**10), args.max_headers, args.request_timeout
    )
    app = create_app(service, args.api_key, args.shutdown_timeout, http_limits)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=bounded_protocol(http_limits),
        # the engine ends each running request by --shutdown-timeout (an error event for a stream): uvicorn waits
        # a little longer for those answers to go out
        timeout_graceful_shutdown=int(args.shutdown_timeout) + SHUTDOWN_MARGIN_S,
    )
    StoppingServer(config, service, args.shutdown_timeout).run()


def shard_note(model) -> str:
    shard = model.expert_shard
    return f", experts in {shard.count} processes" if shard is not None else ""


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or Ctrl-C also tells the engine at once: waiting requests get a 503 (a
    stream an error event) and running ones --shutdown-timeout to finish, while uvicorn stops taking connections
    (otherwise everything queued would run first, past the time given)."""

    def __init__(self, config: uvicorn.Config, service: Service, timeout_s: float):
        super().__init__(config)
        self.service, self.timeout_s = service, timeout_s

    def handle_exit(self, sig, frame):
        self.service.begin_stop(self.timeout_s)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(run_cli(main))
