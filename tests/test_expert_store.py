"""The expert store: written atomically, memory-mapped at open, truncation and corruption caught."""

import json

import ml_dtypes
import numpy as np
import pytest

from host_kernels.errors import StoreError
from host_kernels.store import ExpertStore, StoreWriter


def write_store(path, dtype="float32", layers=(0, 2)):
    rng = np.random.default_rng(0)
    arrays = {i: (rng.standard_normal((3, 8, 10)), rng.standard_normal((3, 5, 8))) for i in layers}
    writer = StoreWriter(path, dtype)
    for i, (w13, w2) in arrays.items():
        writer.add_layer(i, w13, w2)
    writer.close()
    return arrays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_memory_mapped(tmp_path, dtype):
    arrays = write_store(tmp_path / "store", dtype)
    store = ExpertStore.open(tmp_path / "store", verify=True)
    want = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    for i, (w13, w2) in arrays.items():
        assert isinstance(store[i].w13, np.memmap) and store[i].w13.dtype == want
        np.testing.assert_array_equal(store[i].w13, w13.astype(want))
        np.testing.assert_array_equal(store[i].w2, w2.astype(want))
    assert not (tmp_path / "store.partial").exists()


def test_truncated_store_fails_at_open(tmp_path):
    write_store(tmp_path / "store")
    file = tmp_path / "store" / "layer0002.w2.bin"
    file.write_bytes(file.read_bytes()[:-4])
    with pytest.raises(StoreError, match=r"layer0002.w2.bin: layer 2 w2 is 476 bytes, expected 480"):
        ExpertStore.open(tmp_path / "store")


def test_corrupt_store_fails_checksum(tmp_path):
    write_store(tmp_path / "store")
    file = tmp_path / "store" / "layer0000.w13.bin"
    data = bytearray(file.read_bytes())
    data[10] ^= 0xFF
    file.write_bytes(bytes(data))
    ExpertStore.open(tmp_path / "store")  # sizes still match: only the checksum can tell
    with pytest.raises(StoreError, match="layer 0 w13 checksum mismatch"):
        ExpertStore.open(tmp_path / "store", verify=True)


def test_other_layout_version_is_refused(tmp_path):
    write_store(tmp_path / "store")
    manifest = tmp_path / "store" / "manifest.json"
    content = json.loads(manifest.read_text())
    content["layout_version"] = 99
    manifest.write_text(json.dumps(content))
    with pytest.raises(StoreError, match="layout version 99"):
        ExpertStore.open(tmp_path / "store")


def test_unfinished_store_does_not_open(tmp_path):
    writer = StoreWriter(tmp_path / "store")
    writer.add_layer(0, np.zeros((2, 4, 6)), np.zeros((2, 3, 4)))  # no close(): a crash mid-conversion
    with pytest.raises(StoreError, match="not found"):
        ExpertStore.open(tmp_path / "store")


def test_missing_layer_named(tmp_path):
    write_store(tmp_path / "store")
    with pytest.raises(StoreError, match="no layer 1"):
        ExpertStore.open(tmp_path / "store")[1]
