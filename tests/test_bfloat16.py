"""bfloat16 models (dense on XLA, experts on AMX where the CPU has it) against float32 truth and transformers."""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

import moe_jax
from host_kernels import choose_kernels
from moe_jax.model.lora import LoRAConfig
from moe_jax.native.dense import dense_kernel, pack_dense
from moe_jax.train.objective import lora_value_and_grad
from tests.hf_models import hf_logits, make_hf_model, save_hf_model, torch


def relative_error(got, truth):
    return float(np.linalg.norm(np.asarray(got, np.float64) - truth) / np.linalg.norm(truth))


# qwen3_moe: tied head, shared-less, 16 experts; gpt_oss: sinks, biases, the clamped SwiGLU on the host's passes;
# (qwen3_next: layer by layer, in tests/test_qwen3_next.py)
# (minimax_m2's sigmoid scores plus correction bias sit near ties on a tiny random model: bfloat16 flips an expert
# choice here or there on either side, so its layers are compared instead, below)
@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("backend", ["host", "device"])
def test_logits_as_close_to_float32_as_transformers_in_bfloat16(variant, backend, tmp_path):
    hf = make_hf_model(variant)
    save_hf_model(hf, tmp_path)
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, size=(3, 13))
    truth = hf_logits(hf, ids).astype(np.float64)
    hf_bf16_error = relative_error(hf_logits(hf.to(torch.bfloat16), ids), truth)
    model = moe_jax.load_model(tmp_path, backend=backend, dtype="bfloat16")
    error = relative_error(model.logits(ids), truth)
    assert error < 2 * hf_bf16_error + 1e-3, (error, hf_bf16_error)


def test_minimax_m2_layer_in_bfloat16_follows_transformers_bfloat16_layer(tmp_path):
    """Attention (q/k norms over the whole projections, partial rotary) and the MoE block of layer 0, given
    transformers' own bfloat16 inputs: within bfloat16's rounding of its outputs."""
    import jax.numpy as jnp

    hf = make_hf_model("minimax_m2")
    model = moe_jax.load_model(save_hf_model(hf, tmp_path), backend="device", dtype="bfloat16")
    hf = hf.to(torch.bfloat16)
    seen = {}
    layer = hf.model.layers[0]
    layer.register_forward_pre_hook(lambda m, a, k: seen.update(x=a[0] if a else k["hidden_states"]), with_kwargs=True)
    layer.self_attn.register_forward_hook(lambda m, i, o: seen.update(attention=o[0]))
    layer.mlp.register_forward_hook(lambda m, i, o: seen.update(moe_in=i[0], moe=o))
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, size=(3, 13))
    with torch.no_grad():
        hf(torch.as_tensor(ids))
    as_jax = {k: jnp.asarray(v.float().numpy(), jnp.bfloat16) for k, v in seen.items()}
    ours = model.transformer.layers[0]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    attention, _ = ours.self_attn(ours.input_layernorm(as_jax["x"]), positions)
    truth = {k: np.asarray(v.float().numpy(), np.float64) for k, v in seen.items()}
    assert relative_error(attention, truth["attention"]) < 1e-2
    assert relative_error(ours.mlp(as_jax["moe_in"]), truth["moe"]) < 2e-2


def loss_and_grads(path, dtype, keep_transposed=True, native=None, native_head=True):
    model = moe_jax.load_model(path, backend="host", dtype=dtype, native=native)
    if not keep_transposed:
        model.plan = dataclasses.replace(model.plan, transposed_weights=False)
    if not native_head:
        model.plan = dataclasses.replace(model.plan, training_head="")
    model.attach_lora(LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "experts")), seed=3)
    value_and_grad, lora_state = lora_value_and_grad(model)
    # non-zero B matrices, so every adapter gradient is non-trivial
    lora_state = jax.tree.map(lambda a: a + 0.05 * np.ones(a.shape, a.dtype), lora_state)
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(2, 150))  # > 2 query chunks
    loss, grads = value_and_grad(lora_state, tokens, np.ones_like(tokens))
    return float(loss), {k: np.asarray(v, np.float64) for k, v in nnx_flat(grads).items()}, model


def nnx_flat(state):
    return {"/".join(map(str, path)): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_training_step_in_bfloat16_follows_float32(tmp_path):
    save_hf_model(make_hf_model("mixtral", seed=4), tmp_path)
    loss32, grads32, _ = loss_and_grads(tmp_path, "float32")
    loss16, grads16, model = loss_and_grads(tmp_path, "bfloat16")
    assert (
        model.placement.runtime.compute.engine.kernel == choose_kernels(ml_dtypes.bfloat16).gemm
    )  # native where it runs
    # the head's fast backward: packed for the native product where the plan says, else a transposed copy
    if model.plan.training_head:
        assert model.transformer.training_head is not None and model.transformer.head_copy is None
    else:
        assert model.transformer.head_copy is not None
    assert abs(loss16 - loss32) < 2e-2 * abs(loss32)
    assert grads16.keys() == grads32.keys() and any("experts" in k for k in grads16)
    # this test model's wide random weights make bfloat16 rounding cost 4-19% per gradient (the same with the
    # experts in float32, below); a wrong transpose or tile would cost ~100%
    for name in grads32:
        assert relative_error(grads16[name], grads32[name]) < 0.25, name

    # the experts' own rounding (AMX against float32 GEMMs on the same bfloat16 weights) is smaller: under 1% per
    # layer call (tests/test_host_kernels.py), 1.5-8% here once the wide weights' routing has amplified it
    _, grads_numpy, numpy_model = loss_and_grads(tmp_path, "bfloat16", native=False)
    assert numpy_model.placement.runtime.compute.engine.kernel == "numpy"
    for name in grads16:
        assert relative_error(grads16[name], grads_numpy[name]) < 0.12, name

    # the head's products on XLA (its transposed copy) instead of natively: the same up to summation order
    _, grads_xla_head, xla_head = loss_and_grads(tmp_path, "bfloat16", native_head=False)
    assert xla_head.transformer.head_copy is not None and xla_head.transformer.training_head is None
    for name in grads16:
        assert relative_error(grads_xla_head[name], grads16[name]) < 2e-2, name

    # without the transposed copies (both numpy): the same up to summation order, which routing amplifies here
    _, grads_plain, plain = loss_and_grads(tmp_path, "bfloat16", keep_transposed=False, native=False)
    assert plain.transformer.head_copy is None and plain.placement.runtime.compute.engine.kernel == "numpy"
    for name in grads16:
        assert relative_error(grads_plain[name], grads_numpy[name]) < 5e-2, name


@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_transposed_copy_changes_where_the_backward_reads_not_what_it_computes(out_dtype):
    import jax.numpy as jnp

    from moe_jax.model.layers import frozen_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((6, 48)), jnp.float32)

    def loss(x, w_t):
        return jnp.sum(frozen_matmul(x, w, w_t, out_dtype=out_dtype).astype(jnp.float32) * c)

    with_copy = np.asarray(jax.grad(loss)(x, jnp.array(w.T)), np.float64)
    without = np.asarray(jax.grad(loss)(x, None), np.float64)
    exact = np.asarray(c, np.float64) @ np.asarray(w, np.float64).T
    # both round the cotangent and the result to bfloat16 (0.4% a value); a wrong transpose would be ~100% off
    assert relative_error(with_copy, exact) < 1e-2 and relative_error(without, exact) < 1e-2
    assert relative_error(with_copy, without) < 1e-2


def test_one_row_product_equals_its_row_of_a_two_row_product():
    """Batch-1 decode takes the padded path of frozen_matmul (XLA:CPU's one-row bfloat16 product is slow)."""
    import jax.numpy as jnp

    from moe_jax.model.layers import frozen_matmul

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 40)), jnp.bfloat16)
    one = jax.jit(frozen_matmul)(x[:1], w)
    assert one.shape == (1, 1, 40) and one.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(jax.jit(frozen_matmul)(x, w)[:1], np.float32))


@pytest.mark.skipif(not dense_kernel()[0], reason=f"no native dense kernel: {dense_kernel()[1]}")
def test_native_head_product_and_its_input_gradient():
    import jax.numpy as jnp

    from moe_jax.model.layers import native_frozen_matmul

    kernel = dense_kernel()[0]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 7, 70)), jnp.bfloat16)  # k and n off the kernels' 32 and 16
    w = jnp.asarray(rng.standard_normal((70, 45)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((2, 7, 45)), jnp.float32)
    packed, packed_t = pack_dense(w, kernel), pack_dense(w.T, kernel)

    def loss(x):
        return jnp.sum(native_frozen_matmul(x, packed, packed_t, 45, kernel, out_dtype=jnp.float32) * c)

    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = native_frozen_matmul(x, packed, packed_t, 45, kernel, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), x64 @ w64, rtol=1e-5, atol=1e-4)  # float32 sums of exact products
    grad = jax.jit(jax.grad(loss))(x)
    assert grad.dtype == jnp.bfloat16 and grad.shape == x.shape
    exact = np.asarray(c, np.float64) @ w64.T  # the cotangent rounded to bfloat16, then the result: ~0.4% a value
    assert relative_error(np.asarray(grad, np.float64), exact) < 1e-2
