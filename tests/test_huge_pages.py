"""Weights that decode steps stream sit on huge pages (host_kernels/huge_pages.py): arenas hand out aligned, separate
arrays from mappings advised MADV_HUGEPAGE; the fused forward's packed experts, a quantized layer, a store's mapped
files and generation's packed dense weights all come from one, or are advised so."""

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

import moe_jax
from host_kernels.fused_forward import KERNELS, pack_layer
from host_kernels.huge_pages import CHUNK_BYTES, HUGE_PAGE, HugePageArena
from host_kernels.layer_experts import LayerExperts, quantize_layer
from host_kernels.store import ExpertStore, StoreWriter
from moe_jax.model.layers import Attention
from moe_jax.native.dense import pack_dense
from tests.hf_models import make_hf_model, save_hf_model
from tests.isa import kernel_variants

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP = THP_SETTING.read_text() if THP_SETTING.exists() else "not available: no " + str(THP_SETTING)
needs_smaps = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")
FLOAT_KERNELS = kernel_variants(KERNELS, ["avx512-f32", "avx2-f32"])


def mapping_at(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding `address`: its range, VmFlags and AnonHugePages (kB)."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found = {"start": start, "end": end} if start <= address < end else None
        elif found is not None and fields[0] == "VmFlags:":
            return found | {"flags": fields[1:]}
        elif found is not None and fields[0] == "AnonHugePages:":
            found["anon_huge_kb"] = int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arrays_are_aligned_separate_and_outlive_the_arena():
    arena = HugePageArena(chunk_bytes=1 << 20)
    shapes = [((3, 5), np.float32), ((7,), np.uint16), ((300, 1000), np.float32), ((1,), np.uint8), ((64, 3), np.int8)]
    arrays = [arena.empty(shape, dtype) for shape, dtype in shapes]
    for i, (a, (shape, dtype)) in enumerate(zip(arrays, shapes, strict=True)):
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % 64 == 0
        a[...] = i + 1
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))  # no two overlap
    del arena
    assert all((a == i + 1).all() for i, a in enumerate(arrays))  # each array keeps its mapping


def test_a_request_larger_than_a_chunk_gets_its_own_and_chunks_start_on_huge_pages():
    arena = HugePageArena()
    small = arena.empty((10,), np.float32)
    large = arena.empty((CHUNK_BYTES // 4 + 1,), np.float32)
    after = arena.empty((10,), np.float32)
    assert large.ctypes.data % HUGE_PAGE == 0  # a fresh chunk, 2 MB-aligned
    assert small.ctypes.data % HUGE_PAGE == 0
    large[-1] = 5.0
    after[:] = 1.0
    assert large[-1] == 5.0


@needs_smaps
def test_arena_mappings_are_advised_and_get_huge_pages():
    arena = HugePageArena()
    a = arena.empty((4 * HUGE_PAGE,), np.uint8)
    a[:] = 1  # pages become resident when written
    mapping = mapping_at(a.ctypes.data)
    assert "hg" in mapping["flags"]  # MADV_HUGEPAGE
    if "[never]" in THP or "[madvise]" not in THP and "[always]" not in THP:
        pytest.skip(f"transparent huge pages are off here ({THP.strip()}): advised, but on 4 KB pages")
    # the kernel may fall back to 4 KB pages when it finds no free 2 MB ones; of four, at least one it found
    assert mapping["anon_huge_kb"] >= HUGE_PAGE // 1024


def layer(experts=4, hidden=96, ffn=200, seed=0):
    rng = np.random.default_rng(seed)
    w13 = rng.standard_normal((experts, hidden, 2 * ffn)).astype(np.float32)
    w2 = rng.standard_normal((experts, ffn, hidden)).astype(np.float32)
    return LayerExperts(w13, w2)


@needs_smaps
@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
def test_a_layers_packed_experts_share_one_advised_mapping(kernel):
    packed = pack_layer(layer(), kernel)
    addresses = [p.data.ctypes.data for pair in packed for p in pair]
    mapping = mapping_at(addresses[0])
    assert "hg" in mapping["flags"]
    assert all(mapping["start"] <= a < mapping["end"] for a in addresses)


@needs_smaps
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantized_layer_is_on_advised_mappings(quant):
    w = quantize_layer(layer(), quant)
    for array in (w.w13_packed, w.w2_packed):
        assert "hg" in mapping_at(array.ctypes.data)["flags"]
    np.testing.assert_array_equal(w.dequantized(1)[1], quantize_layer(layer(), quant).dequantized(1)[1])


@needs_smaps
def test_an_opened_store_maps_its_files_advised(tmp_path):
    writer = StoreWriter(tmp_path / "store")
    writer.add_layer(0, layer().w13, layer().w2)
    writer.close()
    store = ExpertStore.open(tmp_path / "store")
    for array in (store[0].w13, store[0].w2):
        assert "hg" in mapping_at(array.ctypes.data)["flags"]
    np.testing.assert_array_equal(store[0].w2, layer().w2)


@needs_smaps
def test_generations_packed_dense_weights_are_on_an_advised_mapping(tmp_path):
    save_hf_model(make_hf_model("mixtral"), tmp_path / "hf")
    model = moe_jax.load_model(tmp_path / "hf", dtype="float32")
    if not model.plan.dense_decode:
        pytest.skip(f"no native dense products here: {model.plan.reason('dense_decode')}")
    model.generate([[1, 2, 3]], max_new_tokens=2)
    attention = model.transformer.layers[0].self_attn
    assert isinstance(attention, Attention)
    transformer = model.transformer
    for packed in (attention.qkv_packed, transformer.head_packed):
        assert "hg" in mapping_at(packed[...].unsafe_buffer_pointer())["flags"]
    # the arena's copy holds what a packing of its own would
    head = transformer.lm_head[...] if transformer.lm_head is not None else transformer.embed[...].T
    fresh = pack_dense(head, transformer.dense_kernel)
    np.testing.assert_array_equal(np.asarray(transformer.head_packed[...]), np.asarray(fresh))
