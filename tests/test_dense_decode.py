"""Decode steps' and generation prefills' dense products on AMX, AVX512-BF16 or AVX2 for bfloat16 weights, AVX-512
or AVX2 for float32 ones (host_kernels/csrc/xla_dense.c via layers.base_matmul): XLA's float32 sums of the products,
for the shapes a decode step has and, inside `native_prefill`, a prefill's; nowhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from moe_jax.model.config import Router
from moe_jax.model.layers import base_matmul, native_prefill
from moe_jax.model.lora import LoRAConfig, LoRAParam
from moe_jax.model.moe import MoEBlock
from moe_jax.native import dense as native_dense
from tests.hf_models import make_hf_model, save_hf_model

KERNEL, WHY_NOT = native_dense.dense_kernel()  # AMX, else AVX512-BF16, else AVX2
F32_KERNEL, F32_WHY_NOT = native_dense.dense_kernel(np.float32)  # AVX-512, else AVX2
pytestmark = pytest.mark.skipif(not KERNEL, reason=WHY_NOT)
BOTH = [
    pytest.param(jnp.bfloat16, KERNEL, id="bfloat16"),
    pytest.param(jnp.float32, F32_KERNEL, id="float32", marks=pytest.mark.skipif(not F32_KERNEL, reason=F32_WHY_NOT)),
]


def operands(m, k, n, seed=0, dtype=jnp.bfloat16, kernel=KERNEL):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, 1, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    return x, w, native_dense.pack_dense(w, kernel)


SHAPES = [(16, 512, 4096), (16, 64, 128), (5, 40, 37), (1, 96, 200), (16, 1408, 80), (64, 512, 512), (33, 96, 200)]


@pytest.mark.parametrize("dtype, kernel", BOTH)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_same_sums_as_xla(m, k, n, dtype, kernel):
    x, w, packed = operands(m, k, n, dtype=dtype, kernel=kernel)
    native = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, out_dtype=jnp.float32, dense_kernel=kernel))
    if native_dense.takes(kernel, x):
        assert native_dense.TARGET in native.lower(x, w, packed).as_text()
        got = np.asarray(native(x, w, packed))
    else:  # one float32 row: XLA's own product in models; the kernel itself checked here all the same
        got = np.asarray(native_dense.dense_call(x[:, 0], packed, n, kernel))[:, None]
    xla = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 sums, perhaps in another order (AVX2: even and odd k-rows summed apart): within a few float32 steps
    # of the largest sum, and no further from the exact products than XLA's
    np.testing.assert_allclose(got, xla, rtol=1e-6, atol=4e-6 * np.abs(exact).max())
    if dtype == jnp.bfloat16:
        assert np.abs(got - exact).max() <= np.abs(xla - exact).max() * 1.5 + 1e-6
    else:  # one float32 FMA chain per column over k (XLA sums in blocks): within the bound of a summation in order
        magnitude = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
        assert (np.abs(got - exact) <= k * np.finfo(np.float32).eps * magnitude + 1e-30).all()
    if native_dense.takes(kernel, x):
        rounded = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, dense_kernel=kernel))(x, w, packed)
        in_dtype = np.asarray(rounded.astype(jnp.float32))
        np.testing.assert_array_equal(in_dtype, got.astype(dtype).astype(np.float32))  # rounded once, like XLA's


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_a_wide_weight_packs_in_column_chunks_as_it_would_whole(quant, monkeypatch):
    """A head of 151,936 columns is packed PACK_COLUMNS at a time (its float32 temporaries whole were GBs): the
    bytes are those of packing it at once, the last chunk's padding included."""
    kernel, why = native_dense.dense_kernel(quant=quant)
    if not kernel:
        pytest.skip(why)
    monkeypatch.setattr(native_dense, "PACK_COLUMNS", 64)
    w = np.random.default_rng(0).standard_normal((96, 200)).astype(np.float32)  # 3 chunks and a part
    whole = native_dense.KERNELS[kernel].pack(np.asarray(w, native_dense.KERNELS[kernel].pack_dtype)).data
    np.testing.assert_array_equal(np.asarray(native_dense.pack_dense(w, kernel)), whole)


@pytest.mark.parametrize("dtype, kernel", BOTH)
@pytest.mark.parametrize("shape", [(65, 1, 64), (2, 3, 64), (4, 64)])
def test_other_shapes_stay_in_xla(shape, dtype, kernel):
    # more rows than a decode batch it takes, several positions (prefill, training), no position axis: XLA's
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal((64, 48)), dtype)
    f = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, dense_kernel=kernel))
    assert native_dense.TARGET not in f.lower(x, w, native_dense.pack_dense(w, kernel)).as_text()


@pytest.mark.parametrize("dtype, kernel", BOTH)
def test_a_prefill_takes_it_inside_native_prefill_only(dtype, kernel):
    # generation's prefill steps (generation/engine.py); Model.logits and training stay in XLA
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 37, 96)), dtype)
    w = jnp.asarray(rng.standard_normal((96, 200)), dtype)
    packed = native_dense.pack_dense(w, kernel)

    def product(x, w, p):
        return base_matmul(x, w, packed=p, out_dtype=jnp.float32, dense_kernel=kernel)

    def prefill_product(x, w, p):
        with native_prefill():
            return product(x, w, p)

    assert native_dense.TARGET not in jax.jit(product).lower(x, w, packed).as_text()
    assert native_dense.TARGET in jax.jit(prefill_product).lower(x, w, packed).as_text()
    got = np.asarray(jax.jit(prefill_product)(x, w, packed))
    xla = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(got, xla, rtol=1e-6, atol=4e-6 * np.abs(xla).max())
    too_many = jnp.zeros((1, native_dense.PREFILL_MAX_ROWS + 1, 96), dtype)  # past the handler's rows: XLA's
    assert native_dense.TARGET not in jax.jit(prefill_product).lower(too_many, w, packed).as_text()


@pytest.mark.skipif(not F32_KERNEL, reason=F32_WHY_NOT)
def test_one_float32_row_is_native():
    # batch 1 of a float32 model runs natively too: q, k and v as one call beat XLA's three matrix-vector products
    x, w, packed = operands(1, 64, 48, dtype=jnp.float32, kernel=F32_KERNEL)
    f = jax.jit(lambda x, w, p: base_matmul(x, w, packed=p, dense_kernel=F32_KERNEL))
    assert native_dense.TARGET in f.lower(x, w, packed).as_text()
    xla = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(np.asarray(f(x, w, packed)), xla, rtol=1e-6, atol=4e-6 * np.abs(xla).max())


@pytest.mark.parametrize("dtype, kernel", BOTH)
def test_bad_operands_are_named(dtype, kernel):
    x, w, packed = operands(native_dense.PREFILL_MAX_ROWS + 1, 64, 32, dtype=dtype, kernel=kernel)
    with pytest.raises(Exception, match="1-8192 rows"):
        jax.block_until_ready(native_dense.dense_call(x[:, 0], packed, 32, kernel))
    x, w, packed = operands(4, 64, 32, dtype=dtype, kernel=kernel)
    with pytest.raises(Exception, match="packed weight of x's k and y's n"):
        jax.block_until_ready(native_dense.dense_call(x[:, 0], packed, 48, kernel))
    other = jnp.float32 if dtype == jnp.bfloat16 else jnp.bfloat16
    with pytest.raises(Exception, match=r"x \[m, k\] \(bf16, or f32 for float32 weights\)"):
        jax.block_until_ready(native_dense.dense_call(x[:, 0].astype(other), packed, 32, kernel))


def with_lora(model):
    """The model with LoRA on every attention projection, its B matrices random (peft starts them at zero)."""
    model.attach_lora(LoRAConfig(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    rng = np.random.default_rng(9)
    lora = nnx.state(model.transformer, LoRAParam)
    lora = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.05, a.dtype), lora)
    model.set_lora_state(lora)
    return model


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_generation_packs_once_and_gives_the_same_tokens(tmp_path, dtype):
    # every attention projection, router and the head natively; LoRA updates added to the native products
    if dtype == "float32" and not F32_KERNEL:
        pytest.skip(F32_WHY_NOT)
    save_hf_model(make_hf_model("mixtral", seed=8), tmp_path)
    prompts = [[5, 9, 14, 3], [7] * 9, [40, 41]]
    model = with_lora(moe_jax.load_model(tmp_path, backend="host", dtype=dtype))
    packed = model.generate(prompts, max_new_tokens=6)
    assert "head_packed" in model.state
    decode = model.generation.steps().decode
    caches, tokens = model.kv.new_caches(2, 16), np.zeros((2, 1), np.int32)
    hlo = decode.lower(model.state_leaves(), caches, tokens, tokens > 0, tokens, tokens).as_text()
    # per layer: q, k and v in one, o, the router; then the head
    assert hlo.count(f"@{native_dense.TARGET}(") == 3 * model.config.num_layers + 1
    plain = with_lora(moe_jax.load_model(tmp_path, backend="host", dtype=dtype, xla_ffi=False))
    assert plain.generate(prompts, max_new_tokens=6) == packed and "head_packed" not in plain.state


@pytest.mark.parametrize("float32_logits", [False, True])
@pytest.mark.parametrize("model_dtype", [jnp.bfloat16, jnp.float32])
def test_router_logits_natively_as_routing_computes_them(model_dtype, float32_logits):
    """A packed router gives `route`'s logits (rounded to the model's dtype, or float32 from float32 inputs as
    DeepSeek's are) to summation order, and so its choices; it is packed in that float dtype, never quantized."""
    if (model_dtype == jnp.float32 or float32_logits) and not F32_KERNEL:
        pytest.skip(F32_WHY_NOT)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((6, 1, 96)), model_dtype)
    router = jnp.asarray(rng.standard_normal((96, 40)) * 0.3, model_dtype)
    block = MoEBlock(router, experts=None, spec=Router(top_k=4, float32_logits=float32_logits))
    plain = block._route(x)
    block.pack_for_decode(lambda dtype: native_dense.dense_kernel(dtype)[0])  # what the plan records
    assert block.router_kernel == (F32_KERNEL if model_dtype == jnp.float32 or float32_logits else KERNEL)
    native = block._native_logits(x)
    assert native is not None and native.dtype == jnp.float32
    x_td = x.reshape(6, 96)
    want = x_td.astype(jnp.float32) @ router.astype(jnp.float32)
    if not float32_logits:
        want = want.astype(model_dtype).astype(jnp.float32)  # (x @ W) in the model's dtype
    rounded = not float32_logits and model_dtype == jnp.bfloat16  # one bf16 step apart where the sums straddle one
    np.testing.assert_allclose(np.asarray(native), np.asarray(want), rtol=2**-7 if rounded else 1e-5, atol=1e-5)
    routed = block._route(x)
    np.testing.assert_array_equal(np.asarray(routed[1]), np.asarray(plain[1]))  # the same experts
    np.testing.assert_allclose(np.asarray(routed[2], np.float32), np.asarray(plain[2], np.float32), rtol=2**-7)
