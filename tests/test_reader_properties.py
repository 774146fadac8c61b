"""Property-based checks of every reader of user files (issue 15): generated safetensors headers, store manifests,
model configs, adapter configs and JSONL lines. The only outcomes allowed are a correct load or the project's own
typed error; any other exception (KeyError, TypeError, OverflowError, ...) or a crash fails the property."""

import json
import math
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from host_kernels.errors import StoreError
from host_kernels.store import ExpertStore, StoreWriter
from moe_jax.errors import CheckpointError, ConfigError, InputError
from moe_jax.formats.adapters import adapter_config
from moe_jax.formats.hf_config import read_hf_config
from moe_jax.formats.safetensors_io import _ITEMSIZES, SafetensorsFile
from moe_jax.formats.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# any JSON value, kept small
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(-3, 40)


def sometimes(valid, *, also=json_values):
    """Mostly values of the right kind (so loads get deep), sometimes anything."""
    return st.one_of(valid, valid, valid, also)


# ---------------------------------------------------------------- safetensors


@st.composite
def safetensors_files(draw):
    entries, offset = {}, 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(sometimes(st.sampled_from(sorted(_ITEMSIZES))))
        shape = draw(sometimes(st.lists(small_ints, max_size=3)))
        size = (
            math.prod(shape) * _ITEMSIZES[dtype]
            if _is_good_shape(shape) and isinstance(dtype, str) and dtype in _ITEMSIZES
            else 4
        )
        start = draw(st.one_of(st.just(offset), small_ints))
        stop = draw(st.one_of(st.just(start + size), small_ints))
        offsets = draw(sometimes(st.just([start, stop])))
        entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if draw(st.integers(0, 9)) == 0:
            entry.pop(draw(st.sampled_from(sorted(entry))))
        entries[f"t{i}"] = draw(sometimes(st.just(entry)))
        offset = max(offset, stop if isinstance(stop, int) else offset)
    header = draw(sometimes(st.just(entries)))
    data = bytes(draw(st.integers(0, 2 * max(offset, 0) + 8)))
    return json.dumps(header).encode(), data


def _is_good_shape(shape) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


@PROPERTY
@given(safetensors_files(), st.booleans())
def test_safetensors_reader_loads_correctly_or_says_why(file, lie_about_length):
    header, data = file
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        length = len(header) + (7 if lie_about_length else 0)
        path.write_bytes(struct.pack("<Q", length) + header + data)
        try:
            f = SafetensorsFile(path)
        except CheckpointError:
            return
        parsed = json.loads(header)
        spans = []
        for name in f.keys():
            entry = parsed[name]
            try:
                array = f.get(name)
            except CheckpointError:
                assert entry["dtype"] not in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
                continue
            start, stop = entry["data_offsets"]
            assert array.shape == tuple(entry["shape"]) and array.nbytes == stop - start
            assert 8 + length + stop <= path.stat().st_size
            spans.append((start, stop))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no two tensors share bytes
        del f


@PROPERTY
@given(st.binary(max_size=64))
def test_safetensors_reader_on_arbitrary_bytes(raw):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(raw)
        try:
            SafetensorsFile(path)
        except CheckpointError:
            pass


# ---------------------------------------------------------------- store manifests


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "experts"
    writer = StoreWriter(path)
    rng = np.random.default_rng(0)
    for layer in (0, 1):
        writer.add_layer(layer, rng.standard_normal((2, 4, 6), np.float32), rng.standard_normal((2, 3, 4), np.float32))
    writer.close()
    return path


def mutate(value, draw, depth=0):
    """`value` with a few of its fields replaced by arbitrary JSON, removed, or added."""
    if isinstance(value, dict) and value and depth < 4:
        value = dict(value)
        for key in draw(st.lists(st.sampled_from(sorted(value)), max_size=2, unique=True)):
            choice = draw(st.integers(0, 3))
            if choice == 0:
                value.pop(key)
            elif choice == 1:
                value[key] = draw(json_values)
            else:
                value[key] = mutate(value[key], draw, depth + 1)
        return value
    if isinstance(value, list) and value and depth < 4:
        value = list(value)
        i = draw(st.integers(0, len(value) - 1))
        value[i] = draw(st.one_of(json_values, st.just(mutate(value[i], draw, depth + 1))))
        return value
    return draw(st.one_of(st.just(value), json_values))


@PROPERTY
@given(st.data())
def test_store_manifest_reader(store_dir, data):
    manifest = json.loads((store_dir / "manifest.json").read_text())
    edited = mutate(manifest, data.draw)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "experts"
        copy.mkdir()
        for f in store_dir.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        (copy / "manifest.json").write_text(json.dumps(edited))
        try:
            store = ExpertStore.open(copy, verify=True)
        except StoreError:
            return
        original = ExpertStore.open(store_dir)
        for experts in store.layers.values():  # whatever opened is a layer of the original store, whole
            same = [k for k, v in original.layers.items() if v.w13.shape == experts.w13.shape]
            assert any(np.array_equal(original.layers[k].w13, experts.w13) for k in same)


# ---------------------------------------------------------------- model configs

MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 40,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "sliding_window": None,
}
QWEN2 = {
    **{k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts", "intermediate_size")},
    "model_type": "qwen2_moe",
    "num_experts": 6,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 36,
    "intermediate_size": 48,
    "mlp_only_layers": [0],
    "use_sliding_window": True,
    "sliding_window": 16,
    "max_window_layers": 1,
    "eos_token_id": [1, 2],
}


@PROPERTY
@given(st.data(), st.sampled_from([MIXTRAL, QWEN2]))
def test_model_config_reader(data, base):
    hf = mutate(base, data.draw)
    try:
        config = read_hf_config(hf)
    except ConfigError:
        return
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts"):
        value = getattr(config, name)
        assert isinstance(value, int) and value >= 1, (name, value)
    assert 1 <= config.num_experts_per_tok <= config.num_experts
    assert config.rms_norm_eps > 0 and config.rope_theta > 0 and math.isfinite(config.rope_theta)
    assert len(config.sliding_windows) == config.num_layers
    assert all(w is None or (isinstance(w, int) and w >= 1) for w in config.sliding_windows)


# ---------------------------------------------------------------- adapter configs

ADAPTER = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}


@PROPERTY
@given(st.data())
def test_adapter_config_reader(data):
    config = mutate(ADAPTER, data.draw)
    try:
        lora = adapter_config(config, "adapter_config.json")
    except CheckpointError:
        return
    assert isinstance(lora.rank, int) and lora.rank >= 1
    assert math.isfinite(lora.scale) and lora.scale > 0 and lora.targets


# ---------------------------------------------------------------- JSONL lines


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "models" / "tiny-moe")


RECORDS = [
    {"prompt": "copy ab >", "completion": " ab"},
    {"messages": [{"role": "user", "content": "copy ab >"}, {"role": "assistant", "content": "ab"}]},
    {"input_ids": [1, 2, 3]},
]


@PROPERTY
@given(st.data(), st.lists(st.sampled_from(RECORDS), min_size=1, max_size=3), st.booleans())
def test_jsonl_readers(tokenizer, data, records, skip_bad_lines):
    from moe_jax.formats.prompts import prompt_token_ids, read_jsonl
    from moe_jax.train.data import load_examples

    lines = []
    for record in records:
        kind = data.draw(st.integers(0, 3))
        if kind == 0:
            lines.append(json.dumps(record))
        elif kind == 1:
            lines.append(json.dumps(mutate(record, data.draw)))
        elif kind == 2:
            lines.append(data.draw(st.text(max_size=20)).replace("\n", " "))
        else:
            lines.append(json.dumps(data.draw(json_values)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text("\n".join(lines) + "\n")
        try:
            examples = load_examples(path, tokenizer, 64, skip_bad_lines=skip_bad_lines)
            assert all(len(e.ids) == len(e.mask) <= 64 for e in examples)
        except InputError:
            pass
        try:
            for number, record in read_jsonl(path):
                ids, _ = prompt_token_ids(record, tokenizer, where=f"{path}:{number}: ")
                assert all(isinstance(i, int) for i in ids)
        except InputError:
            pass
