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
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 33])
@pytest.mark.parametrize("k,n", [(45, 17), (64, 64), (200, 130), (32, 1), (96, 65)])
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
