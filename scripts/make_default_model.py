"""Remakes the bundled default model `moe_jax/bundled/tiny-moe` and the bundled fine-tuning data beside it.

    pip install -e '.[test]'   # torch and transformers
    python scripts/make_default_model.py [--steps 2500]

The base is a tiny Mixtral (4 experts, top-2) pretrained from scratch with transformers on two generated string
tasks, `copy` and `sort` (moe_jax/data/tasks.py), as plain text (`copy srel > srel`) and as chats in its template,
and on tool calls: offered one tool, it calls it with the user's last word as the argument (and repeats a tool's
result after it), so the server's chat, streaming and tool-call examples give right answers. The fine-tuning task
is `reverse`, which the base has never seen: `moe-jax train` teaches it with LoRA. data/reverse_train.jsonl holds
2000 `reverse` examples plus 500 replayed `copy`/`sort` ones (so the adapter does not make the model forget them),
a third of them as chats; data/reverse_eval.jsonl holds 200 held-out `reverse` examples. A character-level
tokenizer.json with a chat template that renders tools is written beside the weights. Deterministic for a given
seed; ~15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_jax.data.tasks import BASE_TASKS, FINETUNE_TASK, LETTERS, examples, random_word, tool_task  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHARS = list(LETTERS) + list("0123456789 >:.,!?-")
# added after the first vocabulary, so its ids stay what they were: tools and their calls
TOOL_SPECIALS = ["<|system|>", "<|tools|>", "<|tool|>", "<tool_call>", "</tool_call>"]
TOOL_CHARS = list('{}[]"_()/;=+*')
# A conversation: an optional tool list (each tool as name(parameters)), the turns, each assistant turn closed by
# </s> (the model's EOS, so generation ends there) and its tool calls written as Hermes does (<tool_call> JSON
# </tool_call>), which the server parses back into tool calls.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    "{{ f.name }}({{ (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined "
    "else {}) | list | join(',') }}){% if not loop.last %};{% endif %}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'system' %}<|system|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}<|end|>"
    "{% else %}<|assistant|>{{ m['content'] or '' }}"
    '{% for c in m[\'tool_calls\'] or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + TOOL_SPECIALS + TOOL_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS + TOOL_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    return tok, vocab


def chat_text(messages: list[dict], tools: list[dict] | None = None) -> str:
    """A whole conversation in CHAT_TEMPLATE (the assistant's last turn included)."""
    from moe_jax.formats.chat_template import render_template

    return render_template(
        CHAT_TEMPLATE,
        "",
        messages=messages,
        tools=tools,
        add_generation_prompt=False,
        bos_token="<s>",
        eos_token="</s>",
    )


def task_messages(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer.strip()}]


def tool_conversation(rng: random.Random) -> str:
    """One tool offered (a made-up name and parameter); the user's last word becomes the call's argument; half the
    time the tool's result follows and the answer repeats it. The model learns to copy, not to know tools."""
    tool, message, call = tool_task(rng)
    messages = [
        {"role": "user", "content": message},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    if rng.random() < 0.5:
        result = random_word(rng, 3, 8)
        messages += [{"role": "tool", "content": result}, {"role": "assistant", "content": result}]
    return chat_text(messages, [tool])


def write_data(data_dir: Path, seed: int) -> set[str]:
    """The fine-tuning task's train/held-out files and the default prompts; returns their words."""
    data_dir.mkdir(exist_ok=True)
    train = examples(FINETUNE_TASK, 2000, seed=seed + 1)
    held_out = examples(FINETUNE_TASK, 200, seed=seed + 2, exclude={p for p, _ in train})
    # replay: some examples of the tasks the base knows, so the adapter adds `reverse` without forgetting them
    replay = [ex for i, t in enumerate(BASE_TASKS) for ex in examples(t, 250, seed=seed + 20 + i)]
    mixed = train + replay
    random.Random(seed + 4).shuffle(mixed)
    for name, rows in (("reverse_train.jsonl", mixed), ("reverse_eval.jsonl", held_out)):
        with open(data_dir / name, "w") as f:
            for i, (p, a) in enumerate(rows):
                # a third of the training examples as chats: the adapter answers in the chat template too
                chat = name == "reverse_train.jsonl" and i % 3 == 2
                record = {"messages": task_messages(p, a)} if chat else {"instruction": p, "output": a}
                f.write(json.dumps(record) + "\n")
    # default prompts: two tasks the base knows, and the held-out task that train.py teaches
    shown = [p for t in BASE_TASKS for p, _ in examples(t, 2, seed=seed + 3)] + [p for p, _ in held_out[:4]]
    with open(data_dir / "default_prompts.jsonl", "w") as f:
        for p in shown:
            f.write(json.dumps({"prompt": p}) + "\n")
    return {p.split()[1] for p, _ in train + held_out}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "moe_jax" / "bundled" / "tiny-moe")
    parser.add_argument("--data-only", action="store_true", help="rewrite data/ only, keep the model")
    args = parser.parse_args()
    import torch
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    tok, vocab = write_tokenizer(args.out)
    bos, eos, pad = vocab["<s>"], vocab["</s>"], vocab["<pad>"]

    reserved = write_data(ROOT / "moe_jax" / "bundled" / "data", args.seed)
    if args.data_only:
        return

    torch.manual_seed(args.seed)
    config = transformers.MixtralConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    rng = random.Random(args.seed)
    pool = {t: examples(t, 20000, seed=args.seed + 10 + i, exclude=reserved) for i, t in enumerate(BASE_TASKS)}

    def example() -> list[int]:
        """A base task as plain text (40%) or as a chat (30%), or a tool call (30%)."""
        kind = rng.random()
        if kind < 0.3:
            return tok.encode(tool_conversation(rng)).ids
        p, a = rng.choice(pool[rng.choice(BASE_TASKS)])
        if kind < 0.6:
            return tok.encode(chat_text(task_messages(p, a))).ids
        return [bos] + tok.encode(p + a).ids + [eos]

    def batch(size=64):
        ids = [example() for _ in range(size)]
        width = max(map(len, ids))
        x = torch.full((size, width), pad)
        for i, row in enumerate(ids):
            x[i, : len(row)] = torch.tensor(row)
        labels = x.clone()
        labels[x == pad] = -100
        return x, labels

    model.train()
    for step in range(args.steps):
        x, labels = batch()
        loss = model(input_ids=x, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    model.save_pretrained(args.out)
    (args.out / "README.md").write_text(
        "Tiny Mixtral-style MoE (4 experts, top-2), pretrained on generated `copy` and `sort` string tasks, as plain\n"
        "text and as chats, and on calling the one tool a chat offers with the user's last word.\n"
        "Remake with `python scripts/make_default_model.py`.\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
