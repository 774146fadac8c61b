"""Quantized experts, int8 (a scale per output column) and int4 (a float16 scale per group of k-rows, llama.cpp's
Q4_0 rule): quantization bounds, each kernel against float64 on the same quantized weights (and, for int4, the
same int8 activations), the fused forward, the dense decode products, and a model's logits against bfloat16 on
the bundled model and held-out text."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy.special import log_softmax

import moe_jax
from host_kernels import HostKernelError, amx, choose_kernels, int4_gemm, int8_gemm, mxfp4_gemm
from host_kernels.errors import KernelArgumentError
from host_kernels.fused_forward import KERNELS, QUANTIZED, FusedForward, best_kernel, pack_layer
from host_kernels.quant import (
    INT4_GROUPS,
    INT16_ACTIVATION_CHUNK,
    QuantizedInt4,
    quantize_activations,
    quantize_activations_int16,
    quantize_int4,
    quantize_int8,
    quantize_mxfp4,
)
from host_kernels.schedule import NOT_ROUTED
from moe_jax.errors import InputError
from moe_jax.model.layers import base_matmul
from moe_jax.native import dense as native_dense
from tests.isa import kernel_variants, variants
from tests.test_fused_forward import make_store, routing

ROOT = Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16


def needs(quant: str):
    """Skips where this CPU runs no kernel for `quant` experts, saying why."""
    kernel, why = best_kernel(BF16, quant)
    return pytest.mark.skipif(not kernel, reason=f"needs a {quant} kernel: {why}")


needs_kernel, needs_int4 = needs("int8"), needs("int4")


def quantizer(kernel):
    """The kernel's quantization of a float weight, and what its products see of bfloat16 rows [m, kp]: int8 per
    32 values (the int4 kernels, AVX2's int8 one), or (AVX-512 and AMX int8) int16 per 128 values up to
    int8_gemm.INTEGER_ROWS rows and the rows themselves above."""
    if KERNELS[kernel].format.bits == 8:
        return quantize_int8, seen_by_int4 if kernel.startswith("avx2") else seen_by_int8
    if KERNELS[kernel].format.name == "mxfp4":
        return quantize_mxfp4, seen_by_int4
    return lambda w: quantize_int4(w, KERNELS[kernel].group), seen_by_int4


def seen_by_int8(rows_kp):
    """bfloat16 rows [m, kp] as the AVX-512 int8 kernels multiply them (quantize_activations_int16 at few rows)."""
    rows = np.asarray(rows_kp, np.float32)
    if rows.shape[0] > int8_gemm.INTEGER_ROWS:
        return rows.astype(np.float64)
    q, d = quantize_activations_int16(rows)
    return q.astype(np.float64) * np.repeat(d, INT16_ACTIVATION_CHUNK, axis=1)[:, : rows.shape[1]]


def seen_by_int4(rows_kp):
    """bfloat16 rows [m, kp] as the integer kernels multiply them: int8 per 32 values (quantize_activations)."""
    q, d = quantize_activations(np.asarray(rows_kp, np.float32))
    m, kp = q.shape
    return (q.astype(np.float64).reshape(m, kp // 32, 32) * d[..., None].astype(np.float64)).reshape(m, kp)


def test_quantization_error_is_at_most_half_a_step_per_column():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 70, 45)).astype(np.float32) * rng.uniform(0.01, 10, (3, 1, 45)).astype(np.float32)
    w[1, :, 7] = 0.0  # a column of zeros: scale 0, stays zeros
    w[2, 5, 3] = -1e4  # an outlier sets its column's step
    qw = quantize_int8(w)
    assert qw.q.dtype == np.int8 and qw.scale.shape == (3, 45) and np.abs(qw.q).max() <= 127
    error = np.abs(qw.dequantize() - w)
    assert (error <= qw.scale[:, None, :] / 2 * (1 + 1e-6) + 1e-30).all()
    assert qw.scale[1, 7] == 0 and (qw.dequantize()[1, :, 7] == 0).all()
    assert qw.q[2, 5, 3] == -127  # the column's largest magnitude maps to the end of the range
    bad = w.copy()
    bad[0, 2, 1] = np.nan
    with pytest.raises(KernelArgumentError, match=r"at \(0, 2, 1\) is not finite"):
        quantize_int8(bad)


@pytest.mark.parametrize("group", INT4_GROUPS)
def test_int4_quantization_error_is_at_most_half_a_step_but_at_the_clipped_end(group):
    rng = np.random.default_rng(group)
    w = rng.standard_normal((2, 300, 45)).astype(np.float32) * rng.uniform(0.01, 10, (2, 1, 45)).astype(np.float32)
    w[1, :group, 7] = 0.0  # a group of zeros: scale 0, stays zeros
    w[0, 5, 3] = -1e3  # an outlier sets its group's step
    qw = quantize_int4(w, group)
    groups = -(-300 // group)  # 300 rows: the last group is shorter
    assert qw.q.dtype == np.int8 and qw.scale.shape == (2, groups, 45) and qw.scale.dtype == np.float16
    assert qw.q.min() >= -8 and qw.q.max() <= 7
    d = np.repeat(qw.scale.astype(np.float32), group, axis=1)[:, :300]  # each weight's step, signed
    step, error = np.abs(d), np.abs(qw.dequantize() - w)
    assert (error <= step * (1 + 1e-3) + 1e-30).all()  # within one step everywhere
    clipped = w / np.where(d != 0, d, 1) > 7.5  # past the last level, 7: rounds to it from up to one step away
    assert (error[~clipped] <= step[~clipped] / 2 * (1 + 1e-3) + 1e-30).all()  # half a step everywhere else
    assert qw.scale[1, 0, 7] == 0 and (qw.dequantize()[1, :group, 7] == 0).all()
    assert qw.q[0, 5, 3] == -8  # the group's extreme value maps to the end of the range
    bad = w.copy()
    bad[0, 2, 1] = np.inf
    with pytest.raises(KernelArgumentError, match=r"at \(0, 2, 1\) is not finite"):
        quantize_int4(bad, group)
    with pytest.raises(KernelArgumentError, match="exceed float16"):
        quantize_int4(np.full((32, 1), 1e6, np.float32), group)
    with pytest.raises(KernelArgumentError, match="group size 48"):
        quantize_int4(w, 48)
    with pytest.raises(KernelArgumentError, match=r"must lie in \[-8, 7\], got \[-8, 9\]"):
        QuantizedInt4(np.array([[9], [-8]], np.int8), np.ones((1, 1), np.float16), 32)


def test_activations_are_quantized_per_32_values_within_half_a_step():
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((5, 96)) * rng.uniform(0.01, 100, (5, 1))).astype(BF16).astype(np.float32)
    a[2, 32:64] = 0.0  # a chunk of zeros: scale 0
    q, d = quantize_activations(a)
    assert q.dtype == np.int8 and d.shape == (5, 3) and np.abs(q).max() == 127 and d[2, 1] == 0
    error = np.abs(q.astype(np.float32).reshape(5, 3, 32) * d[..., None] - a.reshape(5, 3, 32))
    assert (error <= d[..., None] / 2 * (1 + 1e-5) + 1e-30).all()


def bf16_rows(rng, m, k, kp):
    """bfloat16 rows (uint16) [m, kp], zeros past k: the kernels' input; and the same as float32 [m, k]."""
    a = rng.standard_normal((m, k)).astype(BF16)
    rows = np.zeros((m, kp), np.uint16)
    rows[:, :k] = a.view(np.uint16)
    return rows, rows.view(BF16).astype(np.float32)


QUANTIZED_KERNELS = kernel_variants(KERNELS, [kernel for kernels in QUANTIZED.values() for kernel in kernels])
GEMMS = {
    kernel: {"int8": int8_gemm, "mxfp4": mxfp4_gemm}.get(KERNELS[kernel].format.name, int4_gemm)
    for kernel in KERNELS
    if KERNELS[kernel].quantized
}


def isa(kernel: str) -> str:
    """The instruction set of a quantized kernel's GEMM (its name's first part: "avx512-int8" -> "avx512")."""
    return kernel.split("-")[0]


@pytest.mark.parametrize("kernel", QUANTIZED_KERNELS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 29])
@pytest.mark.parametrize("k,n", [(45, 17), (64, 64), (200, 130), (96, 1), (300, 40)])
def test_kernel_matches_float64_on_the_same_quantized_weights(kernel, m, k, n):
    rng = np.random.default_rng(m * 100 + k + n)
    quantize, seen = quantizer(kernel)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32))
    packed = GEMMS[kernel].pack(qw)
    rows, _ = bf16_rows(rng, m, k, packed.kp)
    expected = seen(rows.view(BF16))[:, :k] @ qw.dequantize(np.float64)
    out = GEMMS[kernel].gemm(rows, packed, np.full((m, n), np.nan, np.float32), isa=isa(kernel))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    if n > 16:
        part = np.full((m, n - 16), np.nan, np.float32)
        np.testing.assert_array_equal(GEMMS[kernel].gemm(rows, packed, part, 16, n, isa=isa(kernel)), out[:, 16:])


def test_int16_activations_keep_what_bfloat16_holds_near_the_chunk_largest():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal((4, 160)) * rng.uniform(0.01, 100, (4, 1))).astype(BF16).astype(np.float32)
    a[1, :128] = 0.0  # a chunk of zeros: scale 0
    a[2, 3] = 1e4  # an outlier sets its chunk's scale
    a[3, 128:] = 3e-36 * rng.uniform(1, 2, 32)  # a tiny last chunk (32 values): 1 / d stays finite
    a = a.astype(BF16).astype(np.float32)
    q, d = quantize_activations_int16(a)
    assert q.dtype == np.int16 and d.shape == (4, 2) and d[1, 0] == 0 and (q[1, :128] == 0).all()
    assert np.abs(q).max() < 2**15 and np.isfinite(d).all() and (np.frexp(d[d > 0])[0] == 0.5).all()  # powers of 2
    seen = q * np.repeat(d, INT16_ACTIVATION_CHUNK, axis=1)[:, :160]
    chunk = INT16_ACTIVATION_CHUNK
    largest = np.repeat(np.abs(np.pad(a, ((0, 0), (0, 2 * chunk - 160)))).reshape(4, 2, chunk).max(-1), chunk, 1)
    largest = largest[:, :160]
    near = np.abs(a) >= largest / 2**7  # 8 significant bits within 2^7 of the largest: exact
    assert (seen[near] == a[near]).all() and (~near).any()
    assert (np.abs(seen - a) <= np.repeat(d, chunk, axis=1)[:, :160] / 2).all()
    assert (seen[3, 128:] == a[3, 128:]).all()


@pytest.mark.parametrize("kernel", kernel_variants(KERNELS, QUANTIZED["int8"]))
@pytest.mark.parametrize("m", [1, 2, 3, 5, int8_gemm.INTEGER_ROWS])
def test_int8_kernels_multiply_the_activations_they_say(kernel, m):
    """Rows with outliers, where int16 per 128 (AVX-512 int8 at few rows), int8 per 32 (AVX2) and the rows
    themselves give products further apart than the tolerance: the kernel matches the rule it names only (one
    row and two: one stream through each block; more: tiles; 75 columns: a last block of 11)."""
    rng = np.random.default_rng(m)
    k, n = 700, 75
    qw = quantize_int8(rng.standard_normal((k, n)).astype(np.float32))
    packed = int8_gemm.pack(qw)
    rows, _ = bf16_rows(rng, m, k, packed.kp)
    values = rows.view(BF16).astype(np.float32)
    values[:, ::97] *= 5e3
    rows = values.astype(BF16).view(np.uint16)
    rules = {"int16": seen_by_int8, "int8": seen_by_int4, "exact": lambda r: np.asarray(r, np.float64)}
    expected = {name: rule(rows.view(BF16))[:, :k] @ qw.dequantize(np.float64) for name, rule in rules.items()}
    out = int8_gemm.gemm(rows, packed, np.full((m, n), np.nan, np.float32), isa=isa(kernel))
    error = {name: np.abs(out - e).max() / np.abs(e).max() for name, e in expected.items()}
    named = "int8" if kernel.startswith("avx2") else "int16"
    assert error[named] < 1e-6 and all(e > 1e-5 for name, e in error.items() if name != named), error


@pytest.mark.skipif(not int8_gemm.status(int8_gemm.AMX)[0], reason=f"AMX: {int8_gemm.status(int8_gemm.AMX)[1]}")
@pytest.mark.parametrize("m,k,n", [(17, 64, 16), (100, 2048, 96), (300, 2048, 50), (45, 4100, 33)])
def test_amx_int8_tiles_sum_what_the_streaming_kernel_sums(m, k, n):
    """Row counts past one tile pair and past one L2 chunk of rows (128 rows at k 2048), a k that pads."""
    rng = np.random.default_rng(m + k + n)
    packed = int8_gemm.pack(quantize_int8(rng.standard_normal((k, n)).astype(np.float32)))
    rows, _ = bf16_rows(rng, m, k, packed.kp)
    tiles = int8_gemm.gemm(rows, packed, np.full((m, n), np.nan, np.float32), isa=int8_gemm.AMX)
    stream = int8_gemm.gemm(rows, packed, np.full((m, n), np.nan, np.float32), isa="avx512")
    np.testing.assert_allclose(tiles, stream, rtol=1e-5, atol=1e-5 * np.abs(stream).max())


@needs_kernel
def test_kernel_refuses_bad_arguments():
    packed = int8_gemm.pack(quantize_int8(np.ones((40, 20), np.float32)))
    rows = np.zeros((3, packed.kp), np.uint16)
    with pytest.raises(KernelArgumentError, match="multiple of 16"):
        int8_gemm.gemm(rows, packed, np.empty((3, 12), np.float32), 8, 20)
    with pytest.raises(KernelArgumentError, match="expected uint16 rows of at least 64"):
        int8_gemm.gemm(np.zeros((3, 40), np.uint16), packed, np.empty((3, 20), np.float32))
    with pytest.raises(KernelArgumentError, match="packed int8 weight"):  # data that is not what k and n say
        int8_gemm.PackedInt8(packed.data[:, :-64], packed.k, packed.n)
    with pytest.raises(KernelArgumentError, match="one \\[k, n\\] weight"):
        int8_gemm.pack(quantize_int8(np.ones((2, 40, 20), np.float32)))


@pytest.mark.parametrize("isa", variants(int4_gemm.status))
@pytest.mark.parametrize("k, n, group", [(45, 17, 32), (200, 130, 64), (300, 40, 128), (96, 1, 32)])
def test_native_int4_unpack_equals_numpys(isa, k, n, group):
    # training's backward on int4 experts reads the weights through it
    rng = np.random.default_rng(k + n)
    packed = int4_gemm.pack(quantize_int4(rng.standard_normal((k, n)).astype(np.float32), group))
    np.testing.assert_array_equal(int4_gemm.unpack_native(packed, isa), int4_gemm.unpack_numpy(packed))


@pytest.mark.skipif(not int4_gemm.bf16_tiles_status()[0], reason=f"AVX-512: {int4_gemm.bf16_tiles_status()[1]}")
@pytest.mark.parametrize("k, n, group", [(2048, 96, 32), (768, 64, 32), (45, 17, 32), (200, 130, 64), (40, 48, 32)])
def test_int4_weights_unpack_to_bfloat16_tiles_as_packing_the_dequantized_ones_does(k, n, group):
    """Training's GEMMs on an int4 base read each expert dequantized straight into the bfloat16 kernels' tiles, of
    W and of Wᵀ: bit for bit amx.pack_layout of the float32 weights `unpack` gives (padding rows and columns of
    either layout included: shapes off the 16 and 32 multiples)."""
    rng = np.random.default_rng(k * n)
    packed = int4_gemm.pack(quantize_int4(rng.standard_normal((k, n)).astype(np.float32), group))
    weights = int4_gemm.unpack(packed)
    for transposed, expected in ((False, amx.pack_layout(weights)), (True, amx.pack_layout(weights.T))):
        tiles = int4_gemm.unpack_bf16_tiles(packed, transposed)
        assert (tiles.k, tiles.n) == (expected.k, expected.n)
        np.testing.assert_array_equal(tiles.data, expected.data)


@needs_int4
def test_int4_kernel_refuses_bad_arguments():
    packed = int4_gemm.pack(quantize_int4(np.ones((40, 20), np.float32), 64))
    with pytest.raises(KernelArgumentError, match="multiple of 16"):
        int4_gemm.gemm(np.zeros((3, packed.kp), np.uint16), packed, np.empty((3, 12), np.float32), 8, 20)
    with pytest.raises(KernelArgumentError, match="packed int4 weight"):  # data that is not what k, n, group say
        int4_gemm.PackedInt4(packed.data, packed.k, packed.n, 32)
    with pytest.raises(KernelArgumentError, match="one \\[k, n\\] weight"):
        int4_gemm.pack(quantize_int4(np.ones((2, 40, 20), np.float32)))


def quantized_reference(kernel, w, x, ids, weights):
    """float64 forward over the kernel's dequantized weights, its inputs and SwiGLU outputs rounded to bfloat16
    and then seen as the kernel sees them (int4: int8 per 32 values)."""
    quantize, seen = quantizer(kernel)
    w13, w2 = (quantize(a.astype(np.float32)).dequantize(np.float64) for a in (w.w13, w.w2))
    f, d = w.ffn, w.hidden

    def as_seen(rows, k):
        padded = np.zeros((rows.shape[0], amx.padded(k, 32)), BF16)
        padded[:, :k] = rows
        return seen(padded)[:, :k]

    xs = as_seen(x.astype(BF16), d)
    y = np.zeros((x.shape[0], d))
    for t, k in np.ndindex(ids.shape):
        if ids[t, k] == NOT_ROUTED:
            continue
        h = xs[t] @ w13[ids[t, k]]
        a = as_seen((h[:f] / (1 + np.exp(-h[:f])) * h[f:]).astype(BF16)[None], f)[0]
        y[t] += weights[t, k] * (a @ w2[ids[t, k]])
    return y


@pytest.mark.parametrize("kernel", QUANTIZED_KERNELS)
@pytest.mark.parametrize("store_dtype", [np.float32, BF16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("tokens,skew", [(1, False), (16, False), (300, True)])
def test_fused_forward_matches_the_dequantized_experts(kernel, store_dtype, threads, tokens, skew):
    store = make_store(dtype=store_dtype)
    fused = FusedForward(store, lambda layer: pack_layer(store[layer], kernel), threads, kernel)
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((tokens, 96)) * 2).astype(np.float32)
    ids, weights = routing(rng, tokens, 8, skew=skew)
    ids[::3, 0] = NOT_ROUTED
    for layer in (0, 1):
        expected = quantized_reference(kernel, store[layer], x, ids, weights)
        got = fused.forward(layer, x, ids, weights)
        assert np.abs(got - expected).max() < 2e-3 * np.abs(expected).max()
    totals = fused.take_totals()
    bits = KERNELS[kernel].packed_bits  # the weights read, at the kernel's bits per weight
    assert totals.weight_bytes > 0 and totals.weight_bytes % (3 * 96 * 200 * bits // 8) == 0


# the quantized kernels of dense products (MXFP4 quantizes only experts)
DENSE_KERNELS = kernel_variants(
    KERNELS, [k for name, ks in QUANTIZED.items() if name not in native_dense.EXPERTS_ONLY_FORMATS for k in ks]
)


@pytest.mark.parametrize("kernel", DENSE_KERNELS)
@pytest.mark.parametrize("m, k, n", [(1, 96, 200), (16, 512, 4096), (5, 40, 37), (64, 128, 64), (3, 200, 48)])
@pytest.mark.parametrize("row_dtype", [jnp.bfloat16, jnp.float32])  # a float32 model's rows: rounded to bfloat16
def test_decode_dense_products_on_quantized_weights(kernel, m, k, n, row_dtype):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, 1, k)), row_dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    packed = native_dense.pack_dense(w, kernel)
    product = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, out_dtype=jnp.float32, dense_kernel=kernel))
    assert native_dense.TARGET in product.lower(x, w, packed).as_text()
    quantize, seen = quantizer(kernel)
    dequantized = quantize(np.asarray(w, np.float32)).dequantize(np.float64)
    rows = np.zeros((m, amx.padded(k, 32)), BF16)
    rows[:, :k] = np.asarray(x)[:, 0].astype(BF16)
    expected = seen(rows)[:, :k] @ dequantized
    got = np.asarray(product(x, w, packed))[:, 0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def held_out_token_ids(tokenizer, count=64) -> list[list[int]]:
    lines = (ROOT / "data" / "reverse_eval.jsonl").read_text().splitlines()[:count]
    return [tokenizer.encode(r["instruction"] + r["output"]) for r in map(json.loads, lines)]


# quant -> (largest mean KL against bfloat16 per token, least top-1 agreement, largest perplexity change, least
# greedy continuations equal to bfloat16's of 16, on held-out `reverse` prompts the base model has not learned, so
# its continuations are unsure and part at near ties). int8 (each weight within 1/254 of its column's largest;
# llama.cpp's Q8_0 costs ~0.1% perplexity on 7B models) may move the distribution no more than bfloat16's own
# rounding does from float32's (KL ~1e-3 a token on models of this size): measured 1.5e-4 KL, 0.996 top-1, +0.6%
# perplexity, 16/16. int4 (Q4_0's rule and group; llama.cpp's Q4_0 costs ~4% perplexity on LLaMA-7B, a mean KL of
# a few 1e-2 on 8B models) gets 5% and KL 1.2e-2: measured 7.3e-3 KL, 0.974 top-1, +0.9% perplexity, 10/16 on the
# bfloat16 model, 9.2e-3, 0.967 and 10/16 on the float32 one (AMD Zen 3).
LOGIT_THRESHOLDS = {"int8": (1.2e-3, 0.98, 0.01, 14), "int4": (1.2e-2, 0.95, 0.05, 8)}


@pytest.mark.parametrize("quant", [pytest.param("int8", marks=needs_kernel), pytest.param("int4", marks=needs_int4)])
def test_logits_follow_bfloat16_on_the_bundled_model(quant):
    max_kl, min_top1, max_perplexity_change, min_same = LOGIT_THRESHOLDS[quant]
    path = ROOT / "models" / "tiny-moe"
    bf16 = moe_jax.load_model(path, dtype="bfloat16")
    quantized = moe_jax.load_model(path, dtype="bfloat16", quant=quant)
    assert quantized.plan.host_kernels.fused == best_kernel(BF16, quant)[0] and quantized.quantized_experts
    kl = agree = nll16 = nllq = tokens = predicted = 0.0
    sequences = held_out_token_ids(bf16.tokenizer)
    batch = np.zeros((len(sequences), max(map(len, sequences))), np.int64)  # one shape: one compilation
    for row, ids in enumerate(sequences):
        batch[row, : len(ids)] = ids  # padding after: causal attention leaves the real positions as they are
    all_p, all_q = bf16.logits(batch).astype(np.float64), quantized.logits(batch).astype(np.float64)
    for ids, p, q in zip(sequences, all_p, all_q, strict=True):
        p, q = log_softmax(p[: len(ids)], axis=-1), log_softmax(q[: len(ids)], axis=-1)
        kl += (np.exp(p) * (p - q)).sum()
        agree += (p.argmax(-1) == q.argmax(-1)).sum()
        tokens += len(ids)
        predicted += len(ids) - 1
        nll16 -= p[np.arange(len(ids) - 1), ids[1:]].sum()
        nllq -= q[np.arange(len(ids) - 1), ids[1:]].sum()
    assert kl / tokens < max_kl, kl / tokens
    assert agree / tokens >= min_top1, agree / tokens
    assert abs(np.exp((nllq - nll16) / predicted) - 1) < max_perplexity_change
    # decode steps read the dense weights quantized too (where the plan multiplies them natively): greedy tokens
    # follow bfloat16's on held-out prompts
    if quantized.plan.dense_decode:
        assert quantized.plan.dense_decode == best_kernel(BF16, quant)[0]
    prompts = held_out_token_ids(bf16.tokenizer, 16)
    ours, plain = quantized.generate(prompts, max_new_tokens=6), bf16.generate(prompts, max_new_tokens=6)
    same = sum(a == b for a, b in zip(ours, plain, strict=True))
    assert same >= min_same, same


@pytest.mark.parametrize("quant", [pytest.param("int8", marks=needs_kernel), pytest.param("int4", marks=needs_int4)])
def test_a_float32_model_reads_its_dense_weights_quantized_too(quant):
    """As llama.cpp's Q8_0 / Q4_0 files do whatever the model was trained in: the plan packs the dense weights for
    the quantized kernel (rows rounded to bfloat16 for it), and greedy tokens follow float32's."""
    min_same = LOGIT_THRESHOLDS[quant][3]
    path = ROOT / "models" / "tiny-moe"
    f32 = moe_jax.load_model(path, dtype="float32")
    quantized = moe_jax.load_model(path, dtype="float32", quant=quant)
    assert quantized.plan.dense_decode == best_kernel(BF16, quant)[0]
    assert f"native ({best_kernel(BF16, quant)[0]})" in "\n".join(quantized.plan.lines())
    prompts = held_out_token_ids(f32.tokenizer, 16)
    ours, plain = quantized.generate(prompts, max_new_tokens=6), f32.generate(prompts, max_new_tokens=6)
    assert "head_packed" in quantized.state  # generation multiplied the packed, quantized weights
    assert sum(a == b for a, b in zip(ours, plain, strict=True)) >= min_same


@needs_kernel
def test_what_a_quantized_model_refuses():
    path = ROOT / "models" / "tiny-moe"
    with pytest.raises(InputError, match="runs none on the host"):
        moe_jax.load_model(path, backend="device", quant="int8")
    for backend in ("hybrid", "auto"):
        with pytest.raises(InputError, match="may compute some on the device"):
            moe_jax.load_model(path, backend=backend, quant="int8")
    with pytest.raises(HostKernelError, match="native kernels"):
        moe_jax.load_model(path, quant="int8", native=False)
    with pytest.raises(HostKernelError, match="unknown quantization 'int3'"):
        moe_jax.load_model(path, quant="int3")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_refused_where_the_cpu_lacks_the_kernel(quant):
    if best_kernel(BF16, quant)[0]:
        pytest.skip(f"this CPU has the {quant} kernel")
    with pytest.raises(HostKernelError, match=f"{quant} experts: no kernel on this machine"):
        moe_jax.load_model(ROOT / "models" / "tiny-moe", quant=quant)


@needs_kernel
@needs_int4
def test_packed_copy_counts_its_bytes_per_weight():
    assert choose_kernels(amx.BF16, quant="int8").packed_bytes_per_weight() == 1
    assert choose_kernels(amx.BF16, quant="int4").packed_bytes_per_weight() == 0.5
    assert choose_kernels(np.float32, native=False).packed_bytes_per_weight() == 0
