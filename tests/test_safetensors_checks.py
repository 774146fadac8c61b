"""Malformed safetensors files are refused with a CheckpointError naming the file and tensor, never loaded into a
silently wrong array (issue 15, item 7)."""

import json
import struct

import numpy as np
import pytest

from moe_jax.errors import CheckpointError
from moe_jax.formats.safetensors_io import MAX_HEADER_BYTES, SafetensorsFile, TensorSource, save_safetensors


def write_raw(path, header, data: bytes = b"", header_len: int | None = None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if header_len is None else header_len))
        f.write(blob)
        f.write(data)
    return path


def f32_entry(start, stop, shape):
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, stop]}


def test_well_formed_file_round_trips(tmp_path):
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.int8)
    save_safetensors(tmp_path / "x.safetensors", {"a": a, "b": b})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(f.get("a"), a)
    np.testing.assert_array_equal(f.get("b"), b)


@pytest.mark.parametrize(
    "header, data_bytes, message",
    [
        ({"a": f32_entry(0, 16, [2, 2]), "b": f32_entry(8, 24, [4])}, 24, "'a' and 'b' overlap"),
        ({"a": f32_entry(0, 16, [2, 2]), "b": f32_entry(0, 16, [2, 2])}, 16, "overlap"),
        ({"a": f32_entry(-4, 12, [4])}, 16, "non-negative integers"),
        ({"a": f32_entry(0, 12, [4])}, 16, "hold 12 bytes, but F32 x (4,) is 16"),
        ({"a": f32_entry(0, 32, [4])}, 32, "hold 32 bytes"),
        ({"a": f32_entry(0, 16, [-1, -4])}, 16, "non-negative integers"),
        ({"a": f32_entry(0, 16, [2**62, 2**62])}, 16, "but F32"),
        ({"a": f32_entry(0, 16, [4.0])}, 16, "non-negative integers"),
        ({"a": f32_entry(0, 16, "4")}, 16, "non-negative integers"),
        ({"a": {"dtype": 7, "shape": [4], "data_offsets": [0, 16]}}, 16, "unknown dtype 7"),
        ({"a": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, 16, "unknown dtype 'F33'"),
        ({"a": {"dtype": "F32", "shape": [4]}}, 16, "lacks data_offsets"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}, 16, "two non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, True]}}, 16, "two non-negative integers"),
        ({"a": [0, 16]}, 16, "not an object"),
        ({"a": f32_entry(0, 16, [4])}, 8, "truncated"),
        ({"__metadata__": "x", "a": f32_entry(0, 16, [4])}, 16, "__metadata__"),
        ([1, 2, 3], 0, "JSON list, not an object"),
        ("text", 0, "JSON str, not an object"),
    ],
)
def test_malformed_header_is_a_checkpoint_error(tmp_path, header, data_bytes, message):
    path = write_raw(tmp_path / "bad.safetensors", header, bytes(data_bytes))
    with pytest.raises(CheckpointError, match="bad.safetensors") as info:
        SafetensorsFile(path)
    assert message in str(info.value)


def test_header_not_json(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", b"\xff\xfe{", b"")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        SafetensorsFile(path)


def test_deeply_nested_header_is_a_checkpoint_error(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        SafetensorsFile(path)


def test_header_length_is_capped_before_reading(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", {}, header_len=MAX_HEADER_BYTES + 1)
    with pytest.raises(CheckpointError, match="exceeds the 100000000 limit"):
        SafetensorsFile(path)


def test_dtype_outside_what_moe_jax_loads_is_refused_on_use(tmp_path):
    header = {"a": {"dtype": "F8_E5M2", "shape": [4], "data_offsets": [0, 4]}, "b": f32_entry(4, 8, [1])}
    f = SafetensorsFile(write_raw(tmp_path / "fp8.safetensors", header, bytes(8)))
    assert f.get("b").shape == (1,)
    with pytest.raises(CheckpointError, match="'a' has dtype F8_E5M2, which moe_jax cannot load"):
        f.get("a")


def test_tensor_in_two_shards(tmp_path):
    save_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(2, np.float32)})
    save_safetensors(tmp_path / "b.safetensors", {"w": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match="'w' is in both"):
        TensorSource.open(tmp_path)


@pytest.mark.parametrize(
    "weight_map, message",
    [
        ({"w": "../outside.safetensors"}, "shard names must be file names"),
        ({"w": "/etc/passwd"}, "shard names must be file names"),
        ({"w": 3}, "weight_map is not an object"),
        (["w"], "weight_map is not an object"),
        ({"w": "absent.safetensors"}, "do not exist: absent.safetensors"),
    ],
)
def test_bad_shard_index(tmp_path, weight_map, message):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_safetensors(tmp_path / "outside.safetensors", {"w": np.zeros(2, np.float32)})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json") as info:
        TensorSource.open(directory)
    assert message in str(info.value)


def test_streamed_writes_read_each_tensor_in_turn_and_refuse_one_unlike_its_declaration(tmp_path):
    """write_safetensors asks for each tensor only when it is written (convert's one GGUF tensor in memory at a time);
    one of another shape or dtype than declared is refused by name and no file is left, not even the temporary."""
    import ml_dtypes

    from moe_jax.formats.safetensors_io import write_safetensors

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, ml_dtypes.bfloat16)}
    layout = {name: (a.shape, a.dtype) for name, a in arrays.items()}
    asked = []

    def read(name):
        asked.append(name)
        return arrays[name]

    write_safetensors(tmp_path / "x.safetensors", layout, read)
    assert asked == ["a", "b"]
    f = SafetensorsFile(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(f.get("a"), arrays["a"])
    assert f.dtype_code("b") == "BF16"
    wrong = {**layout, "b": ((4,), np.dtype(np.float32))}
    with pytest.raises(CheckpointError, match=r"tensor 'b' is bfloat16 \(4,\), declared float32 \(4,\)"):
        write_safetensors(tmp_path / "y.safetensors", wrong, read)
    assert not list(tmp_path.glob("y.safetensors*"))
