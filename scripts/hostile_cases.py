"""The hostile-input audit's cases about files (scripts/audit_hostile_inputs.py runs them): malformed checkpoints,
configs, chat templates, expert stores and adapters; and the helpers every case uses."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
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
