"""The host backend's fused forward inside jitted steps: through XLA's FFI, through a Python callback, and against
the engine's callback (all three the same bits), with its metrics and its errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from host_kernels import amx, bf16_gemm, choose_kernels, f32_gemm
from moe_jax.native import ffi as native_ffi
from moe_jax.native import host_experts as native_experts
from tests.hf_models import make_hf_model, save_hf_model

needs_amx = pytest.mark.skipif(not amx.status()[0], reason=f"needs AMX (bfloat16 experts): {amx.status()[1]}")
needs_avx512 = pytest.mark.skipif(not f32_gemm.status()[0], reason=f"needs AVX-512: {f32_gemm.status()[1]}")
# the experts' dtype the fused forward runs here: bfloat16 on AMX, else float32 on AVX-512
NATIVE_DTYPE = "bfloat16" if amx.status()[0] else "float32"
pytestmark = pytest.mark.skipif(
    not (amx.status()[0] or f32_gemm.status()[0]), reason=f"needs AMX or AVX-512: {f32_gemm.status()[1]}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(make_hf_model("mixtral", seed=7), tmp_path_factory.mktemp("mixtral"))


def host_model(path, path_taken: str, dtype=NATIVE_DTYPE):
    """path_taken: "ffi" (the default where built), "callback" (the fused forward through pure_callback) or
    "engine" (no fused forward: the engine's own callback)."""
    if path_taken == "engine":  # this machine's kernels, less the fused forward
        kernels = dataclasses.replace(choose_kernels(jnp.dtype(dtype)), fused="")
        model = moe_jax.load_model(path, backend="host", dtype=dtype, host_kernels=kernels)
        assert model.placement.runtime.compute.fused is None
        return model
    model = moe_jax.load_model(path, backend="host", dtype=dtype, xla_ffi=path_taken == "ffi")
    assert model.plan.experts_ffi == (path_taken == "ffi")
    return model


def test_the_native_calls_are_packed_at_load_not_while_tracing(checkpoint):
    model = host_model(checkpoint, "ffi")
    fused = model.placement.runtime.compute.fused
    assert fused.packed_layers == tuple(model.config.moe_layers)  # before any step was traced
    assert host_model(checkpoint, "callback").placement.runtime.compute.fused.packed_layers == ()


def test_ffi_handler_is_built_here():
    # the install builds it (setup.py, jaxlib's headers); CI must exercise this path, not only the fallbacks
    assert native_ffi.status() == (True, "")


@needs_amx
def test_the_three_paths_give_the_same_bits(checkpoint):
    ids = np.random.default_rng(0).integers(0, 96, size=(3, 11))
    logits = {}
    for path_taken in ("ffi", "callback", "engine"):
        model = host_model(checkpoint, path_taken)
        hlo = model._forward_jit.lower(model.state, ids.astype(np.int32), np.zeros(ids.shape, np.int32)).as_text()
        assert ("moe_jax_host_experts" in hlo) == (path_taken == "ffi")
        logits[path_taken] = model.logits(ids)
        outputs = model.generate([[5, 9, 2], [7, 1, 1, 3, 8]], max_new_tokens=6)
        logits[path_taken + " tokens"] = np.array([t for out in outputs for t in out])
    for name in ("callback", "engine"):
        np.testing.assert_array_equal(logits[name], logits["ffi"])
        np.testing.assert_array_equal(logits[name + " tokens"], logits["ffi tokens"])


@needs_avx512
def test_float32_paths_agree(checkpoint):
    # float32 experts: the fused forward's AVX-512 GEMM, through XLA's FFI and through a callback (the same
    # bits), against the engine's numpy one (summation order differs)
    ids = np.random.default_rng(2).integers(0, 96, size=(2, 12))
    ffi = host_model(checkpoint, "ffi", dtype="float32")
    callback = host_model(checkpoint, "callback", dtype="float32")
    engine = host_model(checkpoint, "engine", dtype="float32")
    assert ffi.placement.runtime.compute.fused is not None
    np.testing.assert_array_equal(callback.logits(ids), ffi.logits(ids))
    np.testing.assert_allclose(ffi.logits(ids), engine.logits(ids), rtol=1e-4, atol=1e-4)
    prompts = [[5, 9, 2], [7, 1, 1, 3, 8]]
    assert ffi.generate(prompts, max_new_tokens=6) == engine.generate(prompts, max_new_tokens=6)


@pytest.mark.skipif(not bf16_gemm.status()[0], reason=f"needs AVX512-BF16: {bf16_gemm.status()[1]}")
def test_bfloat16_paths_agree_without_amx(checkpoint):
    # bfloat16 experts on a CPU without AMX: the AVX512-BF16 kernel through XLA's FFI and through a callback (the
    # same bits), against the engine's numpy path on the same weights (which keeps SwiGLU outputs in float32)
    ids = np.random.default_rng(4).integers(0, 96, size=(2, 12))
    kernels = choose_kernels(jnp.bfloat16)
    if kernels.fused != "avx512-bf16":
        pytest.skip(f"this machine runs bfloat16 experts on {kernels.fused}")
    ffi = host_model(checkpoint, "ffi", dtype="bfloat16")
    callback = host_model(checkpoint, "callback", dtype="bfloat16")
    engine = host_model(checkpoint, "engine", dtype="bfloat16")
    np.testing.assert_array_equal(callback.logits(ids), ffi.logits(ids))
    got, expected = ffi.logits(ids), engine.logits(ids)
    assert np.abs(got - expected).max() < 2e-2 * np.abs(expected).max()
    prompts = [[5, 9, 2], [7, 1, 1, 3, 8]]
    assert ffi.generate(prompts, max_new_tokens=6) == callback.generate(prompts, max_new_tokens=6)


def test_metrics_of_ffi_calls(checkpoint):
    model = host_model(checkpoint, "ffi")
    model.metrics()
    ids = np.random.default_rng(1).integers(0, 96, size=(2, 9))
    model.logits(ids)
    m = model.metrics()
    config = model.config
    assert m.host_calls == len(config.moe_layers)
    for layer in config.moe_layers:
        assert m.tokens_per_expert[layer].sum() == ids.size * config.num_experts_per_tok
    assert m.host_wall_s > 0 and m.host_busy_s > 0 and m.device_wait_s == m.host_wall_s
    assert m.host_flops == len(config.moe_layers) * 2 * ids.size * config.num_experts_per_tok * 3 * (
        config.hidden_size * config.expert_intermediate_size
    )
    itemsize = np.dtype(jnp.dtype(NATIVE_DTYPE)).itemsize
    assert m.host_to_device_bytes == len(config.moe_layers) * ids.size * config.hidden_size * itemsize
    assert model.metrics().host_calls == 0


def test_only_calls_made_by_xla_count_as_its_wait(checkpoint):
    # a callback's wait is recorded around the callback; the native counts add it only for the FFI handler's calls
    ids = np.random.default_rng(3).integers(0, 96, size=(2, 9))
    for path_taken in ("ffi", "callback"):
        model = host_model(checkpoint, path_taken)
        model.logits(ids)
        totals = model.placement.runtime.compute.take_totals()
        assert totals.calls == len(model.config.moe_layers)
        assert (totals.xla_call_seconds > 0) == (path_taken == "ffi")
        assert totals.xla_call_seconds <= totals.seconds


def test_bad_expert_ids_fail_the_step_with_the_reason(checkpoint):
    model = host_model(checkpoint, "ffi")
    fused = model.placement.runtime.compute.fused
    address = fused.call_address(0)

    @jax.jit
    def step(x, ids, weights):
        return native_experts.host_experts_call(address, x, ids, weights)

    x = jnp.ones((2, model.config.hidden_size), NATIVE_DTYPE)
    weights = jnp.ones((2, 2), NATIVE_DTYPE)
    with pytest.raises(Exception, match="host experts: expert id 99 out of range"):
        step(x, jnp.array([[0, 1], [99, 2]], jnp.int32), weights).block_until_ready()
    np.asarray(step(x, jnp.array([[0, 1], [3, 2]], jnp.int32), weights))  # the next call is fine


def test_environment_sets_the_default_and_an_argument_overrides_it(checkpoint, monkeypatch):
    monkeypatch.setenv("MOE_JAX_XLA_FFI", "0")
    assert not moe_jax.load_model(checkpoint, backend="host", dtype=NATIVE_DTYPE).plan.experts_ffi
    assert moe_jax.load_model(checkpoint, backend="host", dtype=NATIVE_DTYPE, xla_ffi=True).plan.experts_ffi
