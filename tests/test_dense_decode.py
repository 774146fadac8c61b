"""Decode steps' dense products on AMX, AVX512-BF16 or AVX2 (host_kernels/csrc/xla_dense.c via
layers.base_matmul): XLA's float32 sums of the bfloat16 products, for the shapes a decode step has, and only there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from moe_jax.model.layers import base_matmul
from moe_jax.model.lora import LoRAConfig, LoRAParam
from moe_jax.native import dense as native_dense
from tests.hf_models import make_hf_model, save_hf_model

KERNEL, WHY_NOT = native_dense.dense_kernel()  # AMX, else AVX512-BF16, else AVX2
pytestmark = pytest.mark.skipif(not KERNEL, reason=WHY_NOT)


def operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, 1, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    return x, w, native_dense.pack_dense(w, KERNEL)


SHAPES = [(16, 512, 4096), (16, 64, 128), (5, 40, 37), (1, 96, 200), (16, 1408, 80), (64, 512, 512), (33, 96, 200)]


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_same_sums_as_xla(m, k, n):
    x, w, packed = operands(m, k, n)
    native = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, out_dtype=jnp.float32, dense_kernel=KERNEL))
    assert native_dense.TARGET in native.lower(x, w, packed).as_text()
    got = np.asarray(native(x, w, packed))
    xla = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 sums, perhaps in another order (AVX2: even and odd k-rows summed apart): within a few float32 steps
    # of the largest sum, and no further from the exact products than XLA's
    np.testing.assert_allclose(got, xla, rtol=1e-6, atol=4e-6 * np.abs(exact).max())
    assert np.abs(got - exact).max() <= np.abs(xla - exact).max() * 1.5 + 1e-6
    rounded = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, dense_kernel=KERNEL))(x, w, packed)
    bf16 = np.asarray(rounded.astype(jnp.float32))
    np.testing.assert_array_equal(bf16, got.astype(jnp.bfloat16).astype(np.float32))  # rounded once, like XLA's


@pytest.mark.parametrize("shape", [(65, 1, 64), (2, 3, 64), (4, 64)])
def test_other_shapes_stay_in_xla(shape):
    # more rows than a decode batch it takes, several positions (prefill, training), no position axis: XLA's
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    f = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, dense_kernel=KERNEL))
    assert native_dense.TARGET not in f.lower(x, w, native_dense.pack_dense(w, KERNEL)).as_text()


def test_bad_operands_are_named():
    x, w, packed = operands(65, 64, 32)
    with pytest.raises(Exception, match="1-64 rows"):
        jax.block_until_ready(native_dense.dense_call(x[:, 0], packed, 32, KERNEL))
    x, w, packed = operands(4, 64, 32)
    with pytest.raises(Exception, match="packed weight of x's k and y's n"):
        jax.block_until_ready(native_dense.dense_call(x[:, 0], packed, 48, KERNEL))


def with_lora(model):
    """The model with LoRA on every attention projection, its B matrices random (peft starts them at zero)."""
    model.attach_lora(LoRAConfig(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    rng = np.random.default_rng(9)
    lora = nnx.state(model.transformer, LoRAParam)
    lora = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.05, a.dtype), lora)
    model.set_lora_state(lora)
    return model


def test_generation_packs_once_and_gives_the_same_tokens(tmp_path):
    # every attention projection and the head natively; LoRA updates added to the native products
    save_hf_model(make_hf_model("mixtral", seed=8), tmp_path)
    prompts = [[5, 9, 14, 3], [7] * 9, [40, 41]]
    model = with_lora(moe_jax.load_model(tmp_path, backend="host", dtype="bfloat16"))
    packed = model.generate(prompts, max_new_tokens=6)
    assert "head_packed" in model.state
    _, decode, _ = model.generation.steps()
    caches, tokens = model.kv.new_caches(2, 16), np.zeros((2, 1), np.int32)
    hlo = decode.lower(model.state_leaves(), caches, tokens, tokens > 0, tokens, tokens).as_text()
    assert hlo.count(f"@{native_dense.TARGET}(") == 4 * model.config.num_layers + 1  # q, k, v, o; head
    plain = with_lora(moe_jax.load_model(tmp_path, backend="host", dtype="bfloat16", xla_ffi=False))
    assert plain.generate(prompts, max_new_tokens=6) == packed and "head_packed" not in plain.state
