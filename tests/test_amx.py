"""The AMX bfloat16 GEMM (host_kernels/amx.py) against float64 products of the same bfloat16-rounded inputs."""

import ml_dtypes
import numpy as np
import pytest

from host_kernels import amx, choose_kernels
from host_kernels.host_moe import HostMoE
from host_kernels.layer_experts import LayerExperts
from host_kernels.store import ExpertStore

pytestmark = pytest.mark.skipif(not amx.status()[0], reason=f"AMX unavailable: {amx.status()[1]}")


def rounded(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 512, 2816), (5, 48, 40), (16, 32, 16), (17, 100, 50), (33, 512, 1408), (64, 1408, 512), (130, 96, 200)],
)
def test_gemm_matches_float64_product_of_rounded_inputs(m, k, n):
    rng = np.random.default_rng(m * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = amx.pack(w)
    out = np.full((m, n), np.nan, np.float32)
    amx.gemm(amx.pack_rows(x, packed.kp), m, packed, out)
    expected = rounded(x) @ rounded(w)
    # float32 accumulation of exact bfloat16 products: the only error is the summation order's
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_column_ranges_strided_output_and_gathered_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    w = rng.standard_normal((64, 200)).astype(np.float32)
    rows = np.array([39, 0, 7, 7, 21])
    packed = amx.pack(w.astype(ml_dtypes.bfloat16))  # bfloat16 weights pack as they are
    a = amx.pack_rows(x, packed.kp, rows)
    assert a.shape == (16, packed.kp) and not a[5:].any() and not a[:, 64:].any()  # zero padding
    big = np.zeros((5, 300), np.float32)
    amx.gemm(a, 5, packed, big[:, 100:164], 32, 96)  # a strided view: row stride 300
    amx.gemm(a, 5, packed, big[:, 200:208], 192, 200)  # a partial last tile
    expected = rounded(x[rows]) @ rounded(w)
    np.testing.assert_allclose(big[:, 100:164], expected[:, 32:96], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(big[:, 200:208], expected[:, 192:200], rtol=1e-5, atol=1e-4)
    assert not big[:, :100].any() and not big[:, 164:200].any() and not big[:, 208:].any()  # nothing else written


def test_bad_arguments_are_refused():
    packed = amx.pack(np.ones((64, 64), np.float32))
    a = amx.pack_rows(np.ones((3, 64), np.float32), packed.kp)
    with pytest.raises(ValueError, match="multiple of 16"):
        amx.gemm(a, 3, packed, np.empty((3, 56), np.float32), 8, 64)
    with pytest.raises(ValueError, match="expected float32"):
        amx.gemm(a, 3, packed, np.empty((3, 64), np.float64))
    with pytest.raises(ValueError, match="expected uint16"):
        amx.gemm(np.zeros((16, 96), np.uint16), 3, packed, np.empty((3, 64), np.float32))


def test_engine_chooses_amx_for_bfloat16_and_numpy_when_told():
    w13 = np.ones((2, 32, 64), ml_dtypes.bfloat16)
    w2 = np.ones((2, 32, 32), ml_dtypes.bfloat16)
    assert HostMoE(ExpertStore({0: LayerExperts(w13, w2)}), threads=1).kernel == "amx-bf16"
    f32 = LayerExperts(w13.astype(np.float32), w2.astype(np.float32))
    assert HostMoE(ExpertStore({0: f32}), threads=1).kernel == "numpy"
    numpy_kernels = choose_kernels(ml_dtypes.bfloat16, native=False)
    assert HostMoE(ExpertStore({0: LayerExperts(w13, w2)}), threads=1, kernels=numpy_kernels).kernel == "numpy"
