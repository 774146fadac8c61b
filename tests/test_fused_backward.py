"""The fused native backward (host_kernels/csrc/moe_backward.c) against the engine's backward from the same kept
pre-activations: the same arithmetic (bfloat16 rows and gradients, the same GEMM kernel and SwiGLU backward), so dx
bit for bit and the routing-weight gradients up to float32 summation order; and ExpertCompute's choice of it."""

import ml_dtypes
import numpy as np
import pytest

from host_kernels import native
from host_kernels.choice import KernelChoice
from host_kernels.compute import ExpertCompute
from host_kernels.errors import HostKernelError, KernelArgumentError
from host_kernels.fused_forward import AVX2_BF16, BACKWARD_KERNELS, KERNELS
from host_kernels.host_moe import HostMoE, SavedActivations
from host_kernels.lora import ExpertLoRA
from host_kernels.schedule import NOT_ROUTED
from tests.isa import kernel_variants
from tests.test_fused_forward import make_store, routing

BF16 = ml_dtypes.bfloat16


def engine_on(kernel: str, store, threads: int = 2) -> HostMoE:
    """The engine with `kernel` for both its GEMMs and its fused forward, and the SwiGLU passes of the same ISA."""
    activations = native.AVX2 if kernel == AVX2_BF16 else native.AVX512
    return HostMoE(store, threads=threads, kernels=KernelChoice(kernel, kernel, activations))


@pytest.mark.parametrize("kernel", kernel_variants(KERNELS, BACKWARD_KERNELS))
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens,skew", [(1, False), (16, False), (300, True)])
def test_the_engines_backward_in_one_call(kernel, threads, tokens, skew):
    store = make_store(dtype=BF16)  # hidden 96, ffn 200: neither a multiple of the tiles
    engine = engine_on(kernel, store, threads)
    fused = engine.fused_forward()
    assert fused.has_backward
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    dy = rng.standard_normal((tokens, 96)).astype(np.float32)
    ids, weights = routing(rng, tokens, 8, skew=skew)
    ids[::4, 1] = NOT_ROUTED  # computed elsewhere: no gradient here
    for layer in (0, 1):
        _, h = fused.forward(layer, x, ids, weights, keep=True)
        kept = h.copy()
        dx, dweights = fused.backward(layer, x, ids, weights, dy, h)
        np.testing.assert_array_equal(h, kept)  # read, not consumed
        expected_dx, expected_dw, _ = engine.backward(
            layer, x, ids, weights, dy, saved=SavedActivations(layer, ids, kept)
        )
        np.testing.assert_array_equal(dx, expected_dx)
        np.testing.assert_allclose(dweights, expected_dw, rtol=1e-5, atol=1e-5 * np.abs(expected_dw).max())
        assert not dweights[ids == NOT_ROUTED].any() and dweights[ids != NOT_ROUTED].any()


@pytest.mark.parametrize("kernel", kernel_variants(KERNELS, BACKWARD_KERNELS))
def test_expert_compute_takes_it_where_it_applies(kernel):
    store = make_store(dtype=BF16)
    compute = ExpertCompute(engine_on(kernel, store))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    dy = rng.standard_normal((40, 96)).astype(np.float32)
    ids, weights = routing(rng, 40, 8)
    _, saved = compute.forward(0, x, ids, weights, keep=True)
    compute.engine.last_stats = None
    dx, dweights, grads = compute.backward(0, x, ids, weights, dy, saved=saved)
    assert compute.engine.last_stats is None and grads is None  # the engine did not run
    assert compute.take_totals().calls == 2  # the fused forward and backward
    # expert LoRA (or no kept pre-activations): the engine's backward
    lora = ExpertLoRA(0.5, gate=(np.zeros((8, 96, 2), np.float32), np.zeros((8, 2, 200), np.float32)))
    engine_dx, _, engine_grads = compute.backward(0, x, ids, weights, dy, lora=lora)
    assert compute.engine.last_stats.kind == "backward" and engine_grads is not None
    np.testing.assert_allclose(engine_dx, dx, rtol=1e-2, atol=1e-2 * np.abs(dx).max())  # zero B: the same function


def test_bad_inputs_are_refused_and_float_kernels_have_none():
    store = make_store(dtype=BF16)
    kernel = next((k for k in BACKWARD_KERNELS if KERNELS[k].status()[0]), None)
    if kernel is None:
        pytest.skip(
            "no bfloat16 fused kernel on this CPU: " + "; ".join(KERNELS[k].status()[1] for k in BACKWARD_KERNELS)
        )
    fused = engine_on(kernel, store).fused_forward()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    ids, weights = routing(rng, 6, 8)
    _, h = fused.forward(0, x, ids, weights, keep=True)
    with pytest.raises(KernelArgumentError, match=r"kept pre-activations are float32 \(12, 399\)"):
        fused.backward(0, x, ids, weights, x, np.ascontiguousarray(h[:, :399]))
    with pytest.raises(KernelArgumentError, match="dy"):
        fused.backward(0, x, ids, weights, x[:, :95], h)
    float_store = make_store(dtype=np.float32)
    float_kernels = [k for k in ("avx512-f32", "avx2-f32") if KERNELS[k].status()[0]]
    if float_kernels:
        f32_engine = HostMoE(float_store, threads=2, kernels=KernelChoice("numpy", float_kernels[0], native.AVX2))
        assert not f32_engine.fused_forward().has_backward
        with pytest.raises(HostKernelError, match="fused backward runs on"):
            f32_engine.fused_forward().backward(0, x, ids, weights, x, h)
