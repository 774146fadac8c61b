"""The fused native forward (host_kernels/csrc/moe_forward.c): the engine's forward in one call — its AMX forward bit
for bit (bfloat16 store), its numpy forward up to float32 summation order (float32 store, AVX-512 and AVX2), a
float64 reference with bfloat16's roundings (bfloat16 store on AVX512-BF16 and AVX2)."""

import gc
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from host_kernels import amx, bf16_gemm, choose_kernels, f32_gemm
from host_kernels.compute import ExpertCompute
from host_kernels.errors import HostKernelError
from host_kernels.fused_forward import (
    AMX_BF16,
    AVX2_BF16,
    AVX2_F32,
    AVX512_BF16,
    AVX512_F32,
    KERNELS,
    FusedForward,
    best_kernel,
    pack_layer,
)
from host_kernels.host_moe import HostMoE, SavedActivations
from host_kernels.layer_experts import LayerExperts, quantize_layer
from host_kernels.schedule import NOT_ROUTED, Routing
from host_kernels.store import ExpertStore
from tests.isa import kernel_variants, variants

BF16 = ml_dtypes.bfloat16
needs_amx = pytest.mark.skipif(not amx.status()[0], reason=f"needs AMX (bfloat16 store): {amx.status()[1]}")
# the store the fused forward runs here: bfloat16 on AMX (bit-identical to the engine), else float32 on AVX-512/AVX2
NATIVE_DTYPE = BF16 if amx.status()[0] else np.float32
needs_native = pytest.mark.skipif(
    not (amx.status()[0] or f32_gemm.status("avx2")[0]), reason=f"needs AMX or AVX2: {f32_gemm.status('avx2')[1]}"
)


def same_as_engine(got, expected):
    """Bit for bit on AMX; with float32 weights up to the summation order."""
    if NATIVE_DTYPE == BF16:
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def make_store(experts=8, hidden=96, ffn=200, layers=(0, 1), seed=0, dtype=NATIVE_DTYPE):
    """Sizes that are not multiples of the tiles (ffn 200 pads to 208 and 224, hidden 96 is three k blocks)."""
    rng = np.random.default_rng(seed)

    def layer():
        w13 = (rng.standard_normal((experts, hidden, 2 * ffn)) * 0.1).astype(dtype)
        return LayerExperts(w13, (rng.standard_normal((experts, ffn, hidden)) * 0.1).astype(dtype))

    return ExpertStore({i: layer() for i in layers})


def routing(rng, tokens, experts, top_k=2, skew=False):
    if skew:  # every token's first choice is expert 3: one expert gets all the rows
        ids = np.stack([[3, *rng.choice([e for e in range(experts) if e != 3], top_k - 1, replace=False)]
                        for _ in range(tokens)])  # fmt: skip
    else:
        ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return ids.astype(np.int32), rng.random((tokens, top_k)).astype(np.float32)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens,skew", [(1, False), (5, False), (16, False), (300, False), (300, True)])
def test_bit_identical_to_the_engine_forward(threads, tokens, skew):
    store = make_store()
    engine = HostMoE(store, threads=threads)
    fused = engine.fused_forward()
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((tokens, 96)) * 2).astype(BF16)
    ids, weights = routing(rng, tokens, 8, skew=skew)
    for layer in (0, 1):
        expected = engine.forward(layer, x.astype(np.float32), ids, weights)
        got32 = fused.forward(layer, x.astype(np.float32), ids, weights)
        np.testing.assert_array_equal(got32, expected)
        got16 = fused.forward(layer, x, ids, weights.astype(BF16))  # bfloat16 routing weights, as a bf16 model
        expected16 = engine.forward(layer, x.astype(np.float32), ids, weights.astype(BF16).astype(np.float32))
        np.testing.assert_array_equal(got16.view(np.uint16), expected16.astype(BF16).view(np.uint16))


def rounded_reference(w: LayerExperts, x, ids, weights):
    """float64 forward with the bfloat16 kernels' roundings: inputs and SwiGLU outputs rounded to bfloat16."""
    f = w.ffn
    xb = x.astype(BF16).astype(np.float64)
    y = np.zeros((x.shape[0], w.hidden))
    for t, k in np.ndindex(ids.shape):
        e = ids[t, k]
        h = xb[t] @ w.w13[e].astype(np.float64)
        a = (h[:f] / (1 + np.exp(-h[:f])) * h[f:]).astype(BF16).astype(np.float64)
        y[t] += weights[t, k] * (a @ w.w2[e].astype(np.float64))
    return y


@pytest.mark.parametrize("kernel", kernel_variants(KERNELS, (AVX512_BF16, AVX2_BF16)))
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens,skew", [(1, False), (5, False), (16, False), (300, True)])
def test_bf16_kernels_match_a_float64_reference(kernel, threads, tokens, skew):
    store = make_store(dtype=BF16)
    fused = FusedForward(store, lambda layer: pack_layer(store[layer], kernel), threads, kernel)
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((tokens, 96)) * 2).astype(np.float32)
    ids, weights = routing(rng, tokens, 8, skew=skew)
    ids[::4, 1] = NOT_ROUTED  # pairs computed elsewhere add nothing
    for layer in (0, 1):
        expected = rounded_reference(store[layer], x, np.where(ids < 0, 0, ids), np.where(ids < 0, 0, weights))
        got = fused.forward(layer, x, ids, weights)
        # float32 sums against float64; a SwiGLU output whose bfloat16 rounding flips costs 2^-8 of one term
        assert np.abs(got - expected).max() < 2e-3 * np.abs(expected).max()
        got16 = fused.forward(layer, x.astype(BF16), ids, weights.astype(BF16))  # as a bfloat16 model calls it
        assert got16.dtype == BF16 and np.abs(got16.astype(np.float32) - got).max() < 2e-2 * np.abs(got).max()


def test_the_fastest_kernel_is_chosen_for_each_store():
    kernel, why = best_kernel(BF16)
    avx2 = f32_gemm.status("avx2")[0]
    if amx.status()[0]:
        assert kernel == "amx-bf16"
    elif bf16_gemm.status()[0]:
        assert kernel == AVX512_BF16 and why == ""
    elif avx2:
        assert kernel == AVX2_BF16 and why == ""
    else:
        assert kernel == "" and "avx512-bf16: CPU lacks" in why and "avx2-bf16: CPU lacks" in why
    assert best_kernel(np.float32)[0] == (AVX512_F32 if f32_gemm.status()[0] else AVX2_F32 if avx2 else "")
    with pytest.raises(HostKernelError, match="cannot read a float32 store"):
        FusedForward(make_store(dtype=np.float32), None, 1, AVX512_BF16)


@needs_native
def test_top_k_above_two_and_all_experts():
    store = make_store(experts=4)
    engine = HostMoE(store, threads=2)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    ids = np.stack([rng.permutation(4) for _ in range(7)]).astype(np.int32)  # top-4 of 4
    weights = rng.random((7, 4)).astype(np.float32)
    same_as_engine(engine.fused_forward().forward(0, x, ids, weights), engine.forward(0, x, ids, weights))


@needs_native
def test_totals_count_calls_tokens_and_routing():
    store = make_store()
    fused = HostMoE(store, threads=2).fused_forward()
    rng = np.random.default_rng(0)
    ids, weights = routing(rng, 10, 8)
    x = rng.standard_normal((10, 96)).astype(np.float32)
    fused.forward(1, x, ids, weights)
    fused.forward(1, x[:4], ids[:4], weights[:4])
    totals = fused.take_totals()
    assert (totals.calls, totals.tokens, totals.pairs) == (2, 14, 28)
    assert totals.flops == 2 * 28 * 3 * 96 * 200
    np.testing.assert_array_equal(
        totals.routed[1], np.bincount(ids.ravel(), minlength=8) + np.bincount(ids[:4].ravel(), minlength=8)
    )
    assert 0 < totals.seconds and 0 < totals.busy_seconds
    assert fused.take_totals().calls == 0  # a take starts afresh


@needs_native
def test_bad_inputs_are_refused_with_what_is_wrong():
    fused = HostMoE(make_store(), threads=2).fused_forward()
    x = np.zeros((3, 96), np.float32)
    ids = np.array([[0, 1], [2, 8], [1, 0]], np.int32)  # 8: one past the last expert
    with pytest.raises(HostKernelError, match=r"layer 0: expert id 8 out of range \[0, 8\)"):
        fused.forward(0, x, ids, np.ones((3, 2), np.float32))
    with pytest.raises(HostKernelError, match="layer 0: expert id -2 out of range"):
        fused.forward(0, x, np.where(ids == 8, -2, ids).astype(np.int32), np.ones((3, 2), np.float32))
    with pytest.raises(HostKernelError, match=r"x is float32 \(3, 64\), expected \[tokens, 96\]"):
        fused.forward(0, np.zeros((3, 64), np.float32), ids % 8, np.ones((3, 2), np.float32))
    with pytest.raises(HostKernelError, match=r"expert ids are int32 \(2, 2\), expected integers \[3, top_k"):
        fused.forward(0, x, ids[:2] % 8, np.ones((2, 2), np.float32))
    # the runner is unharmed
    np.testing.assert_array_equal(fused.forward(0, x, ids % 8, np.zeros((3, 2), np.float32)), np.zeros((3, 96)))


@needs_native
def test_a_traced_step_gets_addresses_of_prepared_layers_only():
    engine = HostMoE(make_store(), threads=2)
    fused = engine.fused_forward()
    with pytest.raises(HostKernelError, match=r"layer 1's fused forward is not packed: FusedForward.prepare"):
        fused.call_address(1)
    assert fused.packed_layers == ()
    fused.prepare([1])
    assert fused.packed_layers == (1,) and fused.call_address(1) == fused.call_address(1)
    if fused.has_backward:
        with pytest.raises(HostKernelError, match="layer 1's fused backward is not packed"):
            fused.backward_call_address(1)
        fused.prepare([1], backward=True)
        assert fused.backward_call_address(1) != fused.call_address(1)
    else:
        with pytest.raises(HostKernelError, match="the fused backward runs on"):
            fused.prepare([1], backward=True)


@pytest.mark.parametrize("kernel", kernel_variants(KERNELS, (AVX512_F32, AVX2_F32)))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens,skew", [(1, False), (16, False), (300, True)])
def test_float32_store_matches_the_engine(kernel, threads, tokens, skew):
    store = make_store(dtype=np.float32)
    engine = HostMoE(store, threads=threads)
    fused = FusedForward(store, lambda layer: pack_layer(store[layer], kernel), threads, kernel)
    assert engine.kernel == "numpy"
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    ids, weights = routing(rng, tokens, 8, skew=skew)
    ids[::3, 1] = NOT_ROUTED
    for layer in (0, 1):
        expected = engine.forward(layer, x, ids, weights)
        np.testing.assert_allclose(fused.forward(layer, x, ids, weights), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", variants(f32_gemm.status))
@pytest.mark.parametrize("m,k,n", [(1, 96, 200), (8, 512, 64), (9, 33, 31), (300, 200, 96)])
def test_f32_gemm_matches_float64_products(m, k, n, isa):
    rng = np.random.default_rng(m + k + n)
    a, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    packed = f32_gemm.pack(w)
    out = f32_gemm.gemm(a, packed, np.empty((m, n), np.float32), isa=isa)
    np.testing.assert_allclose(out, a.astype(np.float64) @ w, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    if n > 32:  # a column range, into a strided output
        wide = np.zeros((m, n + 7), np.float32)
        f32_gemm.gemm(a, packed, wide[:, 3 : 3 + n - 32], 32, n, isa=isa)
        np.testing.assert_array_equal(wide[:, 3 : 3 + n - 32], out[:, 32:])
    with pytest.raises(ValueError, match="multiple of 32"):
        f32_gemm.gemm(a, packed, np.empty((m, n - 16), np.float32), 16, n, isa=isa)


def test_none_where_the_native_kernels_are_turned_off():
    for dtype in (BF16, np.float32):
        choice = choose_kernels(dtype, native=False)
        assert choice.fused == "" and "turned off" in choice.why["fused"]
        assert HostMoE(make_store(dtype=dtype, layers=(0,)), threads=1, kernels=choice).fused_forward() is None


@needs_native
def test_calls_from_several_threads_are_serialised_and_correct():
    store = make_store()
    engine = HostMoE(store, threads=2)
    fused = engine.fused_forward()
    rng = np.random.default_rng(9)
    cases = []
    for tokens in (1, 7, 40, 3):
        x = rng.standard_normal((tokens, 96)).astype(np.float32)
        ids, weights = routing(rng, tokens, 8)
        cases.append((x, ids, weights, engine.forward(0, x, ids, weights)))
    failures = []

    def run(case):
        x, ids, weights, expected = case
        for _ in range(20):
            try:
                same_as_engine(fused.forward(0, x, ids, weights), expected)
            except AssertionError:
                failures.append(len(x))

    threads = [threading.Thread(target=run, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_native
def test_runner_threads_start_on_first_use_and_end_with_the_object():
    def runner_threads() -> set[str]:
        tids = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                if open(f"/proc/self/task/{tid}/comm").read().strip() == "moe-fused-fwd":
                    tids.add(tid)
            except OSError:  # ended meanwhile
                pass
        return tids

    engine = HostMoE(make_store(), threads=3)
    before = runner_threads()  # other tests' runners may still be alive, or end while this one runs
    fused = engine.fused_forward()
    assert runner_threads() <= before  # none until a call needs them
    fused.forward(0, np.ones((2, 96), np.float32), np.array([[0, 1], [2, 3]], np.int32), np.ones((2, 2), np.float32))
    ours = runner_threads() - before
    assert fused.threads == 3 and len(ours) == 2  # the caller is the third
    engine._fused = fused = None
    gc.collect()
    assert not ours & runner_threads()


@needs_native
def test_pairs_routed_elsewhere_add_nothing():
    store = make_store()
    engine = HostMoE(store, threads=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 96)).astype(np.float32)
    ids, weights = routing(rng, 9, 8)
    ids[::2, 1] = NOT_ROUTED  # the hybrid placements' device share
    ids[4] = NOT_ROUTED  # a token with nothing here
    expected = engine.forward(0, x, ids, weights)
    got = engine.fused_forward().forward(0, x, ids, weights)
    same_as_engine(got, expected)
    assert not got[4].any()
    everything_elsewhere = np.full_like(ids, NOT_ROUTED)
    assert not engine.fused_forward().forward(0, x, everything_elsewhere, weights).any()
    fresh = HostMoE(store, threads=2).fused_forward()  # nothing routed in its very first call: no buffers yet
    assert not fresh.forward(1, x, everything_elsewhere, weights).any()


@pytest.mark.parametrize("kernel", kernel_variants(KERNELS, (AMX_BF16, AVX512_BF16, AVX2_BF16, AVX512_F32, AVX2_F32)))
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("tokens,skew", [(1, False), (16, False), (300, True)])
def test_kept_pre_activations_are_the_gate_up_products_in_sorted_order(kernel, threads, tokens, skew):
    dtype = np.float32 if kernel in (AVX512_F32, AVX2_F32) else BF16
    store = make_store(dtype=dtype)
    fused = FusedForward(store, lambda layer: pack_layer(store[layer], kernel), threads, kernel)
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    ids, weights = routing(rng, tokens, 8, skew=skew)
    ids[::3, 1] = NOT_ROUTED  # left out of the sorted rows
    for layer in (0, 1):
        y, h = fused.forward(layer, x, ids, weights, keep=True)
        np.testing.assert_array_equal(y, fused.forward(layer, x, ids, weights))  # keeping changes nothing
        order = Routing.build(ids, 8).order
        rows = (x if dtype == np.float32 else x.astype(BF16)).astype(np.float64)[order // 2]
        w13 = store[layer].w13.astype(np.float64)[ids.reshape(-1)[order]]
        expected = np.einsum("pd,pdf->pf", rows, w13)
        assert h.shape == (len(order), 400) and h.dtype == np.float32
        np.testing.assert_allclose(h, expected, rtol=1e-4, atol=1e-4)


@needs_amx
def test_a_backward_from_kept_pre_activations_is_the_recomputing_one_bit_for_bit():
    store = make_store()
    engine = HostMoE(store, threads=2)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    dy = rng.standard_normal((40, 96)).astype(np.float32)
    ids, weights = routing(rng, 40, 8, skew=True)
    ids[::5, 0] = NOT_ROUTED
    _, h = engine.fused_forward().forward(1, x, ids, weights, keep=True)
    _, saved = engine.forward_keeping(1, x, ids, weights)
    np.testing.assert_array_equal(h, saved.h)
    recomputed = engine.backward(1, x, ids, weights, dy)
    kept = engine.backward(1, x, ids, weights, dy, saved=SavedActivations(1, ids, h))
    for a, b in zip(recomputed[:2], kept[:2], strict=True):
        np.testing.assert_array_equal(a, b)


@needs_native
def test_a_training_forward_keeps_pre_activations_on_float_experts_only():
    store = make_store()
    compute = ExpertCompute(HostMoE(store, threads=2))
    assert compute.fused is not None and compute.keeps_activations
    rng = np.random.default_rng(6)
    x = rng.standard_normal((24, 96)).astype(np.float32)
    ids, weights = routing(rng, 24, 8)
    y, saved = compute.forward(0, x, ids, weights, keep=True)
    assert saved is not None and saved.h.shape == (48, 400)
    np.testing.assert_array_equal(y, compute.forward(0, x, ids, weights)[0])
    assert compute.take_totals().calls == 2  # both were the fused forward's calls
    quantized = ExpertStore({0: quantize_layer(store[0], "int4")}, dtype=BF16)
    kernels = choose_kernels(BF16, quant="int4")
    if not kernels.fused:
        pytest.skip(f"no int4 fused forward here: {kernels.why}")
    compute = ExpertCompute(HostMoE(quantized, threads=2, kernels=kernels))
    assert not compute.keeps_activations  # its forward multiplies int8-quantized activations
