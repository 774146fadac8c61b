"""An interactive chat with a model in its own chat template, the answer streamed as it is generated.

Type a message and Enter; `/reset` starts the conversation over, `/exit` (or Ctrl-D) leaves. Each turn sends the
whole conversation again, and the anchor cache (on by default) lets the prefill skip what the last turn already
computed. With no --model it chats with the bundled default (which was pretrained on string tasks, not on chat:
expect its answers to be copies and sorts of what you type).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import moe_jax
from moe_jax import bundled
from moe_jax.api import AUTO_DTYPE, DTYPE_CHOICES, DTYPE_HELP
from moe_jax.backends import BACKENDS
from moe_jax.cli import MODEL_HELP, prog, run_cli
from moe_jax.errors import InputError
from moe_jax.formats.prompts import render_chat
from moe_jax.generation.anchor_cache import AnchorCache, anchor_token_ids
from moe_jax.generation.batch import Job, Request, Sampling
from moe_jax.generation.engine import GenerationEngine
from moe_jax.generation.sampling import check_sampling
from moe_jax.serving.text_stream import TextStream

COMMANDS = {"/reset": "start the conversation over", "/exit": "leave (or Ctrl-D)"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog=prog("chat"), description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help=MODEL_HELP)
    p.add_argument("--adapter", type=Path, help="LoRA adapter directory (PEFT format, or a train run)")
    p.add_argument("--backend", default="host", choices=list(BACKENDS), help="where the experts run (default: host)")
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--quant", help="quantize the experts as they load: int8, int4, ... (default: as stored)")
    p.add_argument("--system", help="a system message that starts every conversation")
    p.add_argument("--max-new-tokens", type=int, default=512, help="the longest answer, in tokens (default: 512)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 for greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling's mass (default: 0.95)")
    p.add_argument("--seed", type=int, default=0, help="turn i samples with seed + i (default: 0)")
    p.add_argument("--anchor-cache-mb", type=float, default=256.0, help="KV reuse across turns (0: off; default 256)")
    return p.parse_args(argv)


class Chat:
    """One conversation over a loaded model: `answer(text, out)` streams the reply to `out` and keeps both."""

    def __init__(self, model, args):
        if model.tokenizer is None or not model.tokenizer.chat_template:
            raise InputError(
                f"{args.model or bundled.MODEL}: the checkpoint has no chat template; "
                "use `moe-jax infer -p TEXT` instead"
            )
        self.model, self.args = model, args
        self.context = model.config.max_position_embeddings
        cache = None
        if args.anchor_cache_mb > 0:
            cache = AnchorCache(anchor_token_ids(model.tokenizer), budget_bytes=int(args.anchor_cache_mb * 2**20))
        self.engine = GenerationEngine(model, 1, self.context, cache)
        self.sampling = Sampling(args.temperature, args.top_p)
        self.turns = 0
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def answer(self, text: str, out) -> str:
        messages = [*self.messages, {"role": "user", "content": text}]
        tokenizer = self.model.tokenizer
        prompt = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
        room = self.context - len(prompt)
        if room < 1:
            raise InputError(f"the conversation ({len(prompt)} tokens) fills the {self.context}-token context: /reset")
        stream = TextStream(lambda ids: tokenizer.decode(ids))

        def on_token(token: int) -> bool:
            out.write(stream.push(token))
            out.flush()
            return False

        request = Request(prompt, min(self.args.max_new_tokens, room), self.args.seed + self.turns)
        eos = frozenset(self.model.config.eos_token_ids)
        with self.engine.batch(1) as batch:
            batch.admit([Job(request, self.sampling, on_token, eos_ids=eos)])
            while batch.active:
                batch.step()
        out.write(stream.finish() + "\n")
        out.flush()
        self.messages = [*messages, {"role": "assistant", "content": stream.text}]
        self.turns += 1
        return stream.text


def main(argv=None):
    args = parse_args(argv)
    check_sampling(args.temperature, args.top_p, 0, args.seed)
    if args.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be >= 1")
    model = moe_jax.load_model(
        args.model or bundled.MODEL, backend=args.backend, dtype=args.dtype, adapter=args.adapter, quant=args.quant
    )
    chat = Chat(model, args)
    interactive = sys.stdin.isatty()
    if interactive:
        print(", ".join(f"{c}: {what}" for c, what in COMMANDS.items()), file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if text == "/exit":
            return 0
        if text == "/reset":
            chat.reset()
            print("(conversation reset)", file=sys.stderr)
        elif text:
            chat.answer(text, sys.stdout)


if __name__ == "__main__":
    sys.exit(run_cli(main))
