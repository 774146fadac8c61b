"""The hostile-input audit's cases about runs (scripts/audit_hostile_inputs.py runs them): bad data and prompt files,
flags, kills, full and read-only disks, damaged GGUF files."""

from __future__ import annotations

import contextlib
import signal
import struct
import subprocess
import time
from pathlib import Path

from hostile_cases import MODEL, PY, ROOT, Case, infer, train  # (it puts the repository on sys.path)


def data_cases():
    bad_lines = {
        "text a number": ['{"text": 5}'],
        "messages a string": ['{"messages": "hello"}'],
        "message role missing": ['{"messages": [{"content": "x"}]}'],
        "byte order mark": ['\ufeff{"text": "hello"}'],
        "NUL bytes": ['{"text": "a\\u0000b"}', "\0\0\0"],
        "only blank lines": ["", "   ", ""],
        "a JSON list": ["[1, 2, 3]"],
    }
    for name, lines in bad_lines.items():

        def run(w, lines=lines):
            data = w / "data.jsonl"
            data.write_text("\n".join(lines) + "\n")
            return train(w, "--data", data, "--eval-data", data), False, None

        yield Case("data", name, run)

    prompts = {
        "negative token id": [{"input_ids": [-1, 3]}],
        "token id beyond the vocabulary": [{"input_ids": [3, 50]}],
        "boolean token ids": [{"input_ids": [True, False]}],
        "no messages": [{"messages": []}],
        "message content a number": [{"messages": [{"role": "user", "content": 5}]}],
    }
    for name, records in prompts.items():
        yield Case("prompts", name, lambda w, r=records: (infer(MODEL, prompts=r, work=w), False, None))
    # an empty text prompt is the BOS token alone: unconditional generation, a fine input
    yield Case("prompts", "empty text prompt", lambda w: (infer(MODEL, prompts=[{"prompt": ""}], work=w), True, None))


def flag_cases():
    infer_flags = {
        "max-new-tokens 0": ["--max-new-tokens", "0"],
        "max-new-tokens a billion": ["--max-new-tokens", "1000000000"],
        "batch-size 0": ["--batch-size", "0"],
        "temperature nan": ["--temperature", "nan"],
        "temperature inf": ["--temperature", "inf"],
        "top-p 2": ["--top-p", "2"],
        "top-k negative": ["--top-k", "-1"],
        "host-threads 0": ["--host-threads", "0"],
        "host-threads a million": ["--host-threads", "1000000"],
        "device-memory nan": ["--device-memory-mb", "nan"],
        "kv-fraction 2": ["--device-memory-mb", "64", "--kv-fraction", "2"],
        "wave-size 0": ["--wave-size", "0"],
        "seed negative": ["--seed", "-1"],
        "empty stop": ["--stop", ""],
    }
    for name, flags in infer_flags.items():
        yield Case("flags", f"infer {name}", lambda w, f=flags: (infer(MODEL, *f), False, None))
    fine = {
        "top-k above the vocabulary": ["--top-k", "1000000", "--temperature", "0.7"],
        "temperature 1e-30": ["--temperature", "1e-30"],
        "batch-size far above the prompts": ["--batch-size", "100000"],
        "seed 2**70": ["--seed", str(2**70)],
    }
    for name, flags in fine.items():
        yield Case("flags", f"infer {name}", lambda w, f=flags: (infer(MODEL, *f), True, None))
    train_flags = {
        "lora-rank 0": ["--lora-rank", "0"],
        "learning-rate nan": ["--learning-rate", "nan"],
        "max-steps -1": ["--max-steps", "-1"],
        "batch-size 0": ["--batch-size", "0"],
        "unknown lora target": ["--lora-targets", "q_proj,nonsense"],
        "host-threads -2": ["--host-threads", "-2"],
    }
    for name, flags in train_flags.items():
        yield Case("flags", f"train {name}", lambda w, f=flags: (train(w, *f), False, None))


def kill_cases():
    """A run killed by SIGKILL part way must leave nothing half-written where a later run would trust it."""

    def killed(argv_of, settle: float, check_of):
        def run(w):
            argv = argv_of(w)
            process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            time.sleep(settle)
            process.send_signal(signal.SIGKILL)
            process.wait()
            return None, None, check_of

        return run

    def convert_check(work, result):
        out = work / "converted"
        if not out.exists():
            return ""
        probe = subprocess.run([PY, "-c", f"import moe_jax; moe_jax.load_model({str(out)!r}, verify=True)"],
                               capture_output=True, text=True)  # fmt: skip
        return "" if probe.returncode == 0 else f"a killed convert left a broken {out.name}: {probe.stderr[-200:]}"

    def train_check(work, result):
        resumed = subprocess.run(train(work, "--resume"), capture_output=True, text=True, cwd=ROOT)
        fresh = subprocess.run(train(work, "--overwrite"), capture_output=True, text=True, cwd=ROOT)
        if (
            resumed.returncode != 0
            and "no checkpoint" not in resumed.stderr
            and "nothing to resume" not in resumed.stderr
        ):
            return f"--resume after kill -9 failed: {resumed.stderr.strip()[-200:]}"
        return "" if fresh.returncode == 0 else f"--overwrite after kill -9 failed: {fresh.stderr.strip()[-200:]}"

    yield Case(
        "kill",
        "convert killed",
        killed(
            lambda w: [PY, "-m", "moe_jax.convert", "--hf", str(MODEL), "--out", str(w / "converted")],
            3.0,
            convert_check,
        ),
    )
    yield Case("kill", "train killed", killed(lambda w: train(w, "--checkpoint-interval", "1"), 9.0, train_check))


def disk_cases():
    def mounted(w, options):
        point = w / "disk"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        return point if result.returncode == 0 else None

    def full(make_argv, fill: bool):
        def run(w):
            point = mounted(w, "size=600k")
            if point is None:
                return "skip", "mount not allowed here", None
            if fill:  # to the last byte
                with contextlib.suppress(OSError), open(point / "filler", "wb") as f:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
            return make_argv(w, point), False, None

        return run

    def read_only(make_argv):
        def run(w):
            point = mounted(w, "ro,size=1m")
            if point is None:
                return "skip", "mount not allowed here", None
            return make_argv(w, point), False, None

        return run

    convert_into = lambda w, d: [PY, "-m", "moe_jax.convert", "--hf", str(MODEL), "--out", str(d / "c")]  # noqa: E731
    infer_into = lambda w, d: infer(MODEL, "--out", d / "out.jsonl")  # noqa: E731
    train_into = lambda w, d: train(w, out=d / "run")  # noqa: E731
    yield Case("disk", "convert onto a full disk", full(convert_into, fill=True))
    yield Case("disk", "train onto a full disk", full(train_into, fill=True))
    yield Case("disk", "infer onto a full disk", full(infer_into, fill=True))
    yield Case("disk", "convert onto a read-only disk", read_only(convert_into))
    yield Case("disk", "train onto a read-only disk", read_only(train_into))
    yield Case("disk", "infer onto a read-only disk", read_only(infer_into))


def gguf_file(work: Path, template: str | None = None, edit=None) -> Path:
    """A tiny Qwen3-MoE GGUF file with a byte-level tokenizer (as llama.cpp's converter writes one); `edit` changes
    its bytes after."""
    from tokenizers import pre_tokenizers

    from tests.gguf_files import write_gguf
    from tests.hf_models import make_hf_model

    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<|im_start|>", "<|im_end|>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.chat_template": template
        or "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    path = write_gguf(make_hf_model("qwen3_moe", vocab_size=len(tokens)), work / "model.gguf", tokenizer=metadata)
    if edit is not None:
        path.write_bytes(edit(path.read_bytes()))
    return path


def gguf_cases():
    chat = [{"messages": [{"role": "user", "content": "hi"}]}]
    yield Case("gguf", "a good file", lambda w: (infer(gguf_file(w), prompts=chat, work=w), True, None))
    broken = {
        "truncated in the header": lambda b: b[:40],
        "truncated in the tensors": lambda b: b[: len(b) * 2 // 3],
        "tensor count huge": lambda b: b[:8] + struct.pack("<Q", 2**62) + b[16:],
        "not GGUF at all": lambda b: b"PK\x03\x04" + b[4:],
    }
    for name, edit in broken.items():
        yield Case("gguf", name, lambda w, e=edit: (infer(gguf_file(w, edit=e), prompts=chat, work=w), False, None))

    def hostile_template(w):
        template = "{{ cycler.__init__.__globals__.os.system('touch " + str(w / "SENTINEL") + "') }}"

        def check(work, result):
            return "code ran: the sentinel file exists" if (work / "SENTINEL").exists() else ""

        return infer(gguf_file(w, template=template), prompts=chat, work=w), False, check

    yield Case("gguf", "chat template that runs a command", hostile_template)

    def convert_truncated(w):
        def check(work, result):
            left = [p.name for p in work.iterdir() if p.name.startswith("out")]
            return f"left behind: {left}" if left else ""

        source = gguf_file(w, edit=lambda b: b[: len(b) * 2 // 3])
        return [PY, "-m", "moe_jax.convert", "--gguf", str(source), "--out", str(w / "out")], False, check

    yield Case("gguf", "convert a truncated file", convert_truncated)
