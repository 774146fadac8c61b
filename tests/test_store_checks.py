"""Converted expert stores: checksums verified on request from every user path, every manifest field type-checked,
a file truncated under a running job a StoreError instead of a SIGBUS (issue 15, item 9)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import moe_jax
from host_kernels.errors import StoreError
from host_kernels.store import ExpertStore, StoreWriter
from moe_jax.convert import convert
from tests.hf_models import make_hf_model, save_hf_model

ROOT = Path(__file__).resolve().parents[1]


def write_store(path, layers=(0, 1)):
    rng = np.random.default_rng(0)
    writer = StoreWriter(path)
    for layer in layers:
        writer.add_layer(layer, rng.standard_normal((4, 8, 12), np.float32), rng.standard_normal((4, 6, 8), np.float32))
    writer.close()
    return path


def flip_a_byte(file: Path):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("store")
    hf = save_hf_model(make_hf_model("mixtral", seed=4), base / "hf")
    return convert(hf, base / "converted", progress=False)


def corrupt_copy(converted, tmp_path):
    import shutil

    copy = Path(shutil.copytree(converted, tmp_path / "corrupt"))
    flip_a_byte(copy / "experts" / "layer0001.w2.bin")
    return copy


def test_verify_finds_a_corrupt_expert_file(converted, tmp_path):
    copy = corrupt_copy(converted, tmp_path)
    moe_jax.load_model(copy, backend="device")  # same size: only the checksum can tell
    with pytest.raises(moe_jax.CheckpointError, match=r"layer0001.w2.bin: layer 1 w2 checksum mismatch"):
        moe_jax.load_model(copy, backend="device", verify=True)
    moe_jax.load_model(converted, backend="device", verify=True)


@pytest.mark.parametrize("cli", ["infer.py", "train.py"])
def test_verify_flag_on_both_clis(converted, tmp_path, cli):
    copy = corrupt_copy(converted, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (the bundled data holds chats: its template too)
        (copy / name).write_bytes((ROOT / "models" / "tiny-moe" / name).read_bytes())
    result = subprocess.run(  # train.py's and infer.py's default data and prompts
        [sys.executable, str(ROOT / cli), "--model", str(copy), "--verify", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode != 0 and "checksum mismatch" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def edit_manifest(store: Path, edit):
    manifest = json.loads((store / "manifest.json").read_text())
    edit(manifest)
    (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["layers"]["0"]["w13"].update(file="../outside.bin"), "file '../outside.bin' must be a file name"),
        (lambda m: m["layers"]["0"]["w13"].update(file=7), "file 7"),
        (lambda m: m["layers"]["0"]["w13"].update(shape="4,8,12"), "shape '4,8,12' must be three positive integers"),
        (lambda m: m["layers"]["0"]["w13"].update(shape=[4, 8, -12]), "shape [4, 8, -12]"),
        (lambda m: m["layers"]["0"]["w13"].update(shape=[4, 8, 12.0]), "shape [4, 8, 12.0]"),
        (lambda m: m["layers"]["0"]["w2"].update(sha256=None), "sha256 None is not a SHA-256 hex digest"),
        (lambda m: m["layers"]["0"].pop("w2"), "layer 0 w2: entry is NoneType"),
        (lambda m: m["layers"].update({"x": {}}), "layer 'x' must be a layer index"),
        (lambda m: m.update(layers=[1, 2]), "'layers' must be a non-empty object"),
        (lambda m: m.update(dtype=["float32"]), "unsupported dtype ['float32']"),
        (lambda m: m["layers"]["0"]["w13"].update(shape=[4, 8, 10]), "expected 1280 bytes"),
    ],
)
def test_malformed_manifest_is_a_store_error(tmp_path, edit, message):
    store = write_store(tmp_path / "experts")
    edit_manifest(store, edit)
    with pytest.raises(StoreError, match="manifest.json|layer0000") as info:
        ExpertStore.open(store)
    assert message in str(info.value)


def test_manifest_that_is_not_an_object(tmp_path):
    store = write_store(tmp_path / "experts")
    (store / "manifest.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match="not an expert store manifest"):
        ExpertStore.open(store)


def test_store_replaced_by_a_rename_keeps_the_mapped_weights(tmp_path):
    store = ExpertStore.open(write_store(tmp_path / "experts"))
    before = np.array(store[1].w2)
    (tmp_path / "experts").rename(tmp_path / "old")
    write_store(tmp_path / "experts", layers=(0, 1, 2))
    np.testing.assert_array_equal(store[1].w2, before)


def test_file_truncated_under_a_running_job_is_an_error_not_a_crash(tmp_path):
    store = write_store(tmp_path / "experts")
    script = textwrap.dedent(
        f"""
        import os, sys
        from host_kernels.errors import StoreError
        from host_kernels.store import ExpertStore
        store = ExpertStore.open({str(store)!r})
        float(store[0].w13.sum())
        os.truncate({str(store / "layer0001.w13.bin")!r}, 0)  # in place: the mapping now runs past the end
        try:
            float(store[1].w13.sum())
        except StoreError as e:
            print(e)
            sys.exit(3)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 3, (result.returncode, result.stderr)  # a negative code: killed by a signal
    assert "layer0001.w13.bin: written to since the store was opened (1536 -> 0 bytes)" in result.stdout
