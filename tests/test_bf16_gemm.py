"""The bfloat16 GEMMs (AVX512-BF16: host_kernels/csrc/bf16_gemm.c; AVX2: csrc/avx2_gemm.c) against a float64
product of the same bfloat16 values, on odd shapes and column ranges; they read the AMX kernel's packed layout."""

import ml_dtypes
import numpy as np
import pytest

from host_kernels import amx, bf16_gemm
from host_kernels.errors import KernelArgumentError
from tests.isa import variants

BF16 = ml_dtypes.bfloat16


def rows(a: np.ndarray, kp: int) -> np.ndarray:
    """bfloat16 bits of `a`, each row zero-padded to kp columns (what the kernel reads)."""
    out = np.zeros((a.shape[0], kp), np.uint16)
    out[:, : a.shape[1]] = a.astype(BF16).view(np.uint16)
    return out


@pytest.mark.parametrize("isa", variants(bf16_gemm.status))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 16, 33])  # up to 4: one weight stream (bf16_gemm.c)
# k past 2048: the tiled products (m > 4) run in k-chunks, each after the first added to C (the last one shorter)
@pytest.mark.parametrize("k,n", [(45, 17), (64, 64), (200, 130), (32, 1), (96, 65), (2070, 70), (4100, 40)])
def test_matches_float64_on_the_same_bfloat16_values(m, k, n, isa):
    rng = np.random.default_rng(m * 1000 + k + n)
    a = rng.standard_normal((m, k)).astype(BF16)
    w = rng.standard_normal((k, n)).astype(BF16)
    packed = amx.pack_layout(w)
    expected = a.astype(np.float64) @ w.astype(np.float64)
    out = bf16_gemm.gemm(rows(a, packed.kp), packed, np.full((m, n), np.nan, np.float32), isa=isa)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    if n > 16:  # a column range from a block boundary, into a strided output
        wide = np.full((m, n + 5), np.nan, np.float32)
        bf16_gemm.gemm(rows(a, packed.kp), packed, wide[:, 2 : 2 + n - 16], 16, n, isa=isa)
        np.testing.assert_array_equal(wide[:, 2 : 2 + n - 16], out[:, 16:])
        assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, 2 + n - 16 :]).all()  # nothing written outside


@pytest.mark.skipif(not bf16_gemm.status("avx2")[0], reason=f"needs AVX2: {bf16_gemm.status('avx2')[1]}")
def test_bad_arguments_are_refused():
    w = amx.pack_layout(np.ones((40, 20), BF16))
    good = np.zeros((3, w.kp), np.uint16)
    with pytest.raises(KernelArgumentError, match="multiple of 16"):
        bf16_gemm.gemm(good, w, np.empty((3, 12), np.float32), 8, 20)
    with pytest.raises(KernelArgumentError, match="expected uint16 rows of at least 64"):
        bf16_gemm.gemm(np.zeros((3, 40), np.uint16), w, np.empty((3, 20), np.float32))
    with pytest.raises(KernelArgumentError, match="expected float32"):
        bf16_gemm.gemm(good, w, np.empty((3, 20), np.float64))


def numpy_tile_layout(w: np.ndarray) -> np.ndarray:
    """The tile layout spelled out element by element: [n blocks][k blocks][16 pairs][16 columns][2], zero-padded."""
    k, n = w.shape
    kp, np_ = amx.padded(k, amx.K_BLOCK), amx.padded(n, amx.N_BLOCK)
    full = np.zeros((kp, np_), np.uint16)
    full[:k, :n] = w.astype(BF16).view(np.uint16)
    out = np.empty((np_ // 16, kp // 32, 16, 16, 2), np.uint16)
    for nb, kb, pair, col, half in np.ndindex(out.shape):
        out[nb, kb, pair, col, half] = full[kb * 32 + 2 * pair + half, nb * 16 + col]
    return out.reshape(np_ // 16, kp // 32, 512)


@pytest.mark.parametrize("native_pack", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("k,n", [(1, 1), (3, 5), (33, 17), (64, 32), (70, 40)])
def test_the_tile_layout_from_any_strides(native_pack, k, n, monkeypatch):
    if native_pack and not amx.native.status(())[0]:
        pytest.skip(f"native library: {amx.native.status(())[1]}")
    if not native_pack:
        monkeypatch.setattr(amx.native, "status", lambda flags: (False, "turned off by the test"))
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    wide = rng.standard_normal((n, 2 * k)).astype(BF16)
    for view in (w, w.astype(BF16), np.asfortranarray(w).astype(BF16, order="F"), wide[:, ::2].T, wide.T[::2]):
        expected = numpy_tile_layout(view[:k, :n])
        np.testing.assert_array_equal(amx.pack_layout(view[:k, :n]).data, expected)
