"""Hostile-input audit of the CLIs: malformed checkpoints, configs, stores, adapters, data, prompts and flags,
template code, kills, full and read-only disks, damaged GGUF files. Each case runs the real command in a
subprocess on a copy of the bundled model (or a tiny GGUF file) and is judged by what a user would see:

  clean   a non-zero exit with a one-line `error:` message (or, where the input is fine, a zero exit)
  CRASH   death by a signal;  TRACEBACK  a Python traceback;  ACCEPTED  a bad input that exited 0;
  REFUSED a good input refused;  and whatever a case's own check finds (a file deleted, a template's command run).

    python scripts/audit_hostile_inputs.py [--out audit.json] [--only SUBSTRING]

Full and read-only disks need `mount` (root); those cases are skipped, saying so, where it is not allowed.
Direct calls into the native code are covered by tests/test_native_checks.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.gguf_files writes the GGUF cases' files
MODEL = ROOT / "models" / "tiny-moe"
PY = sys.executable


@dataclass
class Case:
    category: str
    name: str
    run: object  # (work dir) -> (argv, expect_ok, check or None); check(work, result) -> problem or ""


def model_copy(work: Path) -> Path:
    dst = work / "model"
    if not dst.exists():
        shutil.copytree(MODEL, dst)
    return dst


def edit_config(work: Path, **changes) -> Path:
    model = model_copy(work)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


def rewrite_header(work: Path, edit) -> Path:
    """The model with its safetensors header passed through `edit(header) -> header` (data left as is)."""
    model = model_copy(work)
    path = model / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8 : 8 + n]))
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    blob += b" " * max(0, n - len(blob))  # keep the data where it was
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    return model


def first_two(header):
    names = [k for k in header if k != "__metadata__"]
    return header[names[0]], header[names[1]]


def overlap(header):
    a, b = first_two(header)
    if a["data_offsets"][1] - a["data_offsets"][0] == b["data_offsets"][1] - b["data_offsets"][0]:
        b["data_offsets"] = list(a["data_offsets"])
    else:
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]
    return header


def infer(model, *flags, prompts=None, work=None):
    argv = [PY, str(ROOT / "infer.py"), "--model", str(model), "--max-new-tokens", "2", *map(str, flags)]
    if prompts is not None:
        path = work / "prompts.jsonl"
        path.write_text("".join((p if isinstance(p, str) else json.dumps(p)) + "\n" for p in prompts))
        argv += ["--prompts", str(path)]
    return argv


def train(work, *flags, model=None, out=None):
    return [
        PY, str(ROOT / "train.py"), "--model", str(model or MODEL), "--out", str(out or work / "run"),
        "--max-steps", "2", "--eval-interval", "2", "--no-progress", *map(str, flags),
    ]  # fmt: skip


def checkpoint_cases():
    bad_headers = {
        "overlapping tensors": overlap,
        "negative offset": lambda h: (first_two(h)[0].update(data_offsets=[-8, 0]), h)[1],
        "offsets not dtype x shape": lambda h: (first_two(h)[0].update(shape=[3, 3]), h)[1],
        "shape with a string": lambda h: (first_two(h)[0].update(shape=["50", 128]), h)[1],
        "dtype an object": lambda h: (first_two(h)[0].update(dtype={"F32": 1}), h)[1],
        "entry a number": lambda h: (h.update({next(iter(h)): 5}), h)[1],
        "header a JSON string": lambda h: b'"hello"',
        "header not UTF-8": lambda h: b"\xc3\x28" * 8,
        "offsets past the file": lambda h: (first_two(h)[0].update(data_offsets=[10**12, 10**12 + 4]), h)[1],
    }
    for name, edit in bad_headers.items():
        yield Case("checkpoint", name, lambda w, e=edit: (infer(rewrite_header(w, e)), False, None))

    def huge_header_length(w):
        model = model_copy(w)
        raw = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + raw[8:])
        return infer(model), False, None

    def truncated(w):
        model = model_copy(w)
        path = model / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return infer(model), False, None

    def empty_file(w):
        model = model_copy(w)
        (model / "model.safetensors").write_bytes(b"")
        return infer(model), False, None

    def index_outside(w):
        model = model_copy(w)
        (w / "elsewhere.safetensors").write_bytes((model / "model.safetensors").read_bytes())
        (model / "model.safetensors").rename(model / "model-00001.safetensors")
        (model / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}})
        )
        return infer(model), False, None

    def duplicated(w):
        model = model_copy(w)
        shutil.copy(model / "model.safetensors", model / "model-copy.safetensors")
        return infer(model), False, None

    for f in (huge_header_length, truncated, empty_file, index_outside, duplicated):
        yield Case("checkpoint", f.__name__.replace("_", " "), f)


def config_cases():
    bad = {
        "layers as a string": {"num_hidden_layers": "2"},
        "zero layers": {"num_hidden_layers": 0},
        "a billion layers": {"num_hidden_layers": 10**9},
        "one layer fewer than the weights": {"num_hidden_layers": 1},
        "negative eps": {"rms_norm_eps": -1e-5},
        "theta infinite": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e400}},
        "zero head dim": {"head_dim": 0},
        "vocab 2**40": {"vocab_size": 2**40},
        "zero experts per token": {"num_experts_per_tok": 0},
        "fractional experts per token": {"num_experts_per_tok": 1.5},
        "negative sliding window": {"sliding_window": -16},
        "model type a list": {"model_type": ["mixtral"]},
        "unknown rope type": {"rope_parameters": {"rope_type": "yarn", "factor": 4}},
        "eos a float": {"eos_token_id": 2.5},
    }
    for name, change in bad.items():
        yield Case("config", name, lambda w, c=change: (infer(edit_config(w, **c)), False, None))

    def not_an_object(w):
        model = model_copy(w)
        (model / "config.json").write_text("[]")
        return infer(model), False, None

    def binary(w):
        model = model_copy(w)
        (model / "config.json").write_bytes(os.urandom(64))
        return infer(model), False, None

    def max_seq_len_beyond_positions(w):
        return train(w, "--max-seq-len", 4096), False, None

    for f in (not_an_object, binary, max_seq_len_beyond_positions):
        yield Case("config", f.__name__.replace("_", " "), f)


def template_cases():
    attacks = {
        "class hierarchy walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "cycler globals": "{{ cycler.__init__.__globals__.os.system('touch SENTINEL') }}",
        "joiner globals": "{{ joiner.__init__.__globals__.os.popen('touch SENTINEL').read() }}",
        "huge range": "{% for i in range(10**9) %}x{% endfor %}",
        "attribute on a format string": "{{ '{0.__class__}'.format(messages) }}",
    }
    for name, template in attacks.items():

        def run(w, template=template):
            model = model_copy(w)
            config = json.loads((model / "tokenizer_config.json").read_text())
            config["chat_template"] = template.replace("SENTINEL", str(w / "SENTINEL"))
            (model / "tokenizer_config.json").write_text(json.dumps(config))
            prompts = [{"messages": [{"role": "user", "content": "hi"}]}]

            def check(work, result):
                return "code ran: the sentinel file exists" if (work / "SENTINEL").exists() else ""

            return infer(model, prompts=prompts, work=w), False, check

        yield Case("template", name, run)


def store_cases():
    def converted(w):
        out = w / "converted"
        subprocess.run([PY, "-m", "moe_jax.convert", "--hf", str(MODEL), "--out", str(out)], check=True,
                       capture_output=True)  # fmt: skip
        return out

    def edit_manifest(edit):
        def run(w):
            store = converted(w) / "experts"
            manifest = json.loads((store / "manifest.json").read_text())
            edit(manifest, store)
            (store / "manifest.json").write_text(json.dumps(manifest))
            return infer(store.parent), False, None

        return run

    yield Case("store", "file outside the store", edit_manifest(lambda m, s: m["layers"]["0"]["w13"].update(
        file="../../model.safetensors")))  # fmt: skip
    yield Case("store", "shape a string", edit_manifest(lambda m, s: m["layers"]["0"]["w2"].update(shape="x")))
    yield Case("store", "layers null", edit_manifest(lambda m, s: m.update(layers=None)))
    yield Case("store", "layer index not a number", edit_manifest(lambda m, s: m["layers"].update(
        {"first": m["layers"]["0"]})))  # fmt: skip

    def flipped_byte_with_verify(w):
        store = converted(w) / "experts"
        file = sorted(store.glob("*.bin"))[0]
        data = bytearray(file.read_bytes())
        data[100] ^= 1
        file.write_bytes(bytes(data))
        return infer(store.parent, "--verify"), False, None

    def file_grown(w):
        store = converted(w) / "experts"
        file = sorted(store.glob("*.bin"))[0]
        with open(file, "ab") as f:
            f.write(b"\0" * 64)
        return infer(store.parent), False, None

    def convert_onto_itself(w):
        model = model_copy(w)
        before = sorted(p.name for p in model.iterdir())

        def check(work, result):
            after = sorted(p.name for p in model.iterdir()) if model.exists() else []
            return "" if after == before else f"source changed: {before} -> {after}"

        return [PY, "-m", "moe_jax.convert", "--hf", str(model), "--out", str(model)], False, check

    def convert_over_user_data(w):
        out = w / "mine"
        out.mkdir()
        (out / "thesis.txt").write_text("years of work")

        def check(work, result):
            return "" if (out / "thesis.txt").exists() else "deleted the user's file"

        return [PY, "-m", "moe_jax.convert", "--hf", str(MODEL), "--out", str(out)], False, check

    for f in (flipped_byte_with_verify, file_grown, convert_onto_itself, convert_over_user_data):
        yield Case("store", f.__name__.replace("_", " "), f)


def q_proj_adapter(fill: float = 0.0, a_in: int = 128) -> dict:
    """PEFT tensors of a rank-4 adapter on both layers' q_proj of the bundled model (hidden 128)."""
    import numpy as np

    return {
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": np.full(shape, fill, np.float32)
        for i in range(2)
        for ab, shape in (("A", (4, a_in)), ("B", (128, 4)))
    }


def adapter_cases():
    def adapter(w, config, tensors=None):
        from moe_jax.formats.safetensors_io import save_safetensors

        path = w / "adapter"
        path.mkdir(exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_safetensors(path / "adapter_model.safetensors", tensors or q_proj_adapter())
        return infer(MODEL, "--adapter", path), False, None

    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    bad = {
        "rank negative": {"r": -4},
        "alpha a string": {"lora_alpha": "8"},
        "targets a number": {"target_modules": 5},
        "DoRA": {"use_dora": True},
        "per-layer ranks": {"rank_pattern": {"layers.0": 8}},
        "config a list": None,
    }
    for name, change in bad.items():
        config = [good] if change is None else {**good, **change}
        yield Case("adapter", name, lambda w, c=config: adapter(w, c))
    yield Case("adapter", "NaN weights", lambda w: adapter(w, good, q_proj_adapter(fill=float("nan"))))
    yield Case("adapter", "wrong tensor shape", lambda w: adapter(w, good, q_proj_adapter(a_in=64)))


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


def judge(argv, expect_ok, check, work) -> tuple[str, str]:
    detail = ""
    if argv is not None:
        result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
        stderr = result.stderr.strip()
        last = stderr.splitlines()[-1] if stderr else ""
        detail = last[:200]
        if result.returncode < 0:
            return "CRASH", f"killed by signal {-result.returncode}"
        if "Traceback (most recent call last)" in stderr:
            return "TRACEBACK", last[:200]
        if expect_ok and result.returncode != 0:
            return "REFUSED", detail
        if not expect_ok and result.returncode == 0:
            return "ACCEPTED", "exit 0 on a bad input"
    else:
        result = None
    problem = check(work, result) if check else ""
    return ("PROBLEM", problem) if problem else ("clean", detail)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON report")
    p.add_argument("--only", help="run the cases whose category or name contains this")
    args = p.parse_args(argv)
    groups = (checkpoint_cases, config_cases, template_cases, store_cases, adapter_cases, data_cases, flag_cases,
              kill_cases, disk_cases, gguf_cases)  # fmt: skip
    report = []
    for case in (c for group in groups for c in group()):
        if args.only and args.only not in f"{case.category} {case.name}":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            start = time.perf_counter()
            try:
                argv_, expect_ok, check = case.run(work)
                if argv_ == "skip":
                    verdict, detail = "skipped", expect_ok
                else:
                    verdict, detail = judge(argv_, expect_ok, check, work)
            finally:
                if (work / "disk").is_mount():
                    subprocess.run(["umount", "--lazy", str(work / "disk")], capture_output=True)
        report.append({"category": case.category, "case": case.name, "verdict": verdict, "detail": detail,
                       "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
        print(f"{verdict:9s} {case.category:10s} {case.name:40s} {detail}", flush=True)
    bad = [r for r in report if r["verdict"] not in ("clean", "skipped")]
    print(f"\n{len(report)} cases: {len(report) - len(bad)} clean or skipped, {len(bad)} not")
    if args.out:
        args.out.write_text(json.dumps({"cases": report, "not_clean": len(bad)}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
