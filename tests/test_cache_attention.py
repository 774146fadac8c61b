"""The native cache attention (host_kernels/csrc/xla_cache_attention.c), each instruction-set variant this CPU
runs, over bfloat16 and float32 caches, decode steps (one token a row) and prefill steps (many, right-padded past
the cache's end), against XLA's own path (layers.attend over the select-written cache): the same cache bits,
outputs equal to the dtype's rounding, in place when donated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.model.layers import attend, write_positions
from moe_jax.native import cache_attention as native_attention
from tests.hf_models import make_hf_model, save_hf_model
from tests.isa import variants

pytestmark = pytest.mark.skipif(not native_attention.status()[0], reason=f"not here: {native_attention.status()[1]}")


def inputs(b, kv, g, s, d, seed=0, dtype=jnp.bfloat16, t=1):
    """A step's operands: t new tokens a row at consecutive positions from a random start inside the cache (the
    first row's at 0, the last's at the cache's last entry, so with t > 1 it runs past the end as padding)."""
    rng = np.random.default_rng(seed)

    def array(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    starts = rng.integers(0, s, (b, 1))
    starts[0, 0], starts[-1, 0] = 0, s - 1
    return (
        array(b, kv, t, g, d),
        array(b, kv, t, d),
        array(b, kv, t, d),
        jnp.asarray((starts + np.arange(t)).astype(np.int32)),
        array(b, kv, s, d),
        array(b, kv, s, d),
    )


def xla_path(window):
    def run(q, k_new, v_new, positions, k_cache, v_cache):
        key_pos = jnp.broadcast_to(jnp.arange(k_cache.shape[2]), (k_cache.shape[0], k_cache.shape[2]))
        k_all = write_positions(k_cache, k_new, positions, key_pos)
        v_all = write_positions(v_cache, v_new, positions, key_pos)
        return attend(q, k_all, v_all, positions, key_pos, window), k_all, v_all

    return jax.jit(run)


def inside_the_cache(out_bktgd, positions_bt, s):
    """The outputs of the tokens at positions inside the cache, as float32: those past its end are right padding
    whose attention (to no key, under a window) neither path defines."""
    inside = np.broadcast_to((np.asarray(positions_bt) < s)[:, None, :, None, None], out_bktgd.shape)
    return np.asarray(out_bktgd, np.float32)[inside]


def native_path(window, donate=False, isa=None):
    def run(q, k_new, v_new, positions, k_cache, v_cache):
        return native_attention.cache_attention_call(q, k_new, v_new, positions, k_cache, v_cache, window, isa)

    return jax.jit(run, donate_argnums=(4, 5) if donate else ())


# (b, kv, t, g, s, d, window): decode steps (t = 1) with odd head sizes (24, 20, 12: vectors part-filled, AVX2's 8
# lanes past d), groups of 1-8, windows, caches shorter and longer than a block of keys; prefill steps of several
# task blocks (64 query rows a block), longer than a chunk of values (64), windowed, and one whose rows run past the
# cache's end
DECODE = [(16, 2, 1, 4, 96, 64, None), (3, 1, 1, 1, 40, 24, None), (5, 4, 1, 2, 200, 128, 17),
          (2, 2, 1, 8, 33, 80, 1), (4, 1, 1, 3, 7, 20, None), (3, 2, 1, 5, 19, 12, 9)]  # fmt: skip
PREFILL = [(2, 2, 40, 4, 96, 64, None), (1, 1, 150, 1, 160, 24, None), (3, 2, 33, 3, 200, 128, 17),
           (2, 1, 9, 8, 12, 20, 5)]  # fmt: skip


@pytest.mark.parametrize("isa", variants(native_attention.status))
@pytest.mark.parametrize("b, kv, t, g, s, d, window", DECODE + PREFILL)
def test_matches_the_xla_path(b, kv, t, g, s, d, window, isa):
    args = inputs(b, kv, g, s, d, t=t)
    want_out, want_k, want_v = xla_path(window)(*args)
    out, k_all, v_all = native_path(window, isa=isa)(*args)
    np.testing.assert_array_equal(np.asarray(k_all), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(v_all), np.asarray(want_v))
    got, want = inside_the_cache(out, args[3], s), inside_the_cache(want_out, args[3], s)
    # the same arithmetic up to summation order and exp: mostly the same bits, the rest one bf16 step apart
    assert (got == want).mean() > 0.95
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-9)


@pytest.mark.parametrize("isa", variants(native_attention.status))
@pytest.mark.parametrize("b, kv, t, g, s, d, window", DECODE[:2] + DECODE[3:] + PREFILL)
def test_float32_caches_match_the_xla_path(b, kv, t, g, s, d, window, isa):
    args = inputs(b, kv, g, s, d, dtype=jnp.float32, t=t)
    want_out, want_k, want_v = xla_path(window)(*args)
    out, k_all, v_all = native_path(window, isa=isa)(*args)
    assert out.dtype == k_all.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(k_all), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(v_all), np.asarray(want_v))
    # float32 throughout, probabilities not rounded: summation order and the exp polynomial (4e-6) apart
    got, want = inside_the_cache(out, args[3], s), inside_the_cache(want_out, args[3], s)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_mixed_dtypes_are_refused():
    q, k_new, v_new, positions, k_cache, v_cache = inputs(2, 1, 2, 16, 32)
    with pytest.raises(Exception, match="all bf16 or all f32"):
        jax.block_until_ready(native_path(None)(q.astype(jnp.float32), k_new, v_new, positions, k_cache, v_cache))


@pytest.mark.parametrize("isa", variants(native_attention.status))
def test_updates_a_donated_cache_in_place_and_leaves_an_undonated_one(isa):
    q, k_new, v_new, positions, k_cache, v_cache = inputs(4, 2, 4, 48, 64, seed=1)
    before = np.asarray(k_cache).copy()
    _, k_all, _ = native_path(None, isa=isa)(q, k_new, v_new, positions, k_cache, v_cache)
    np.testing.assert_array_equal(np.asarray(k_cache), before)  # not donated: a copy was written
    pointer = k_cache.unsafe_buffer_pointer()
    _, k_donated, _ = native_path(None, donate=True, isa=isa)(q, k_new, v_new, positions, k_cache, v_cache)
    assert k_donated.unsafe_buffer_pointer() == pointer  # aliased: written where it was
    np.testing.assert_array_equal(np.asarray(k_donated), np.asarray(k_all))


def test_a_position_outside_the_cache_is_an_error():
    q, k_new, v_new, positions, k_cache, v_cache = inputs(2, 1, 2, 16, 32)
    with pytest.raises(Exception, match="a position is outside the cache"):
        jax.block_until_ready(native_path(None)(q, k_new, v_new, jnp.full((2, 1), 16, jnp.int32), k_cache, v_cache))
    with pytest.raises(Exception, match="a position is outside the cache"):
        jax.block_until_ready(native_path(None)(q, k_new, v_new, jnp.full((2, 1), -1, jnp.int32), k_cache, v_cache))


def step_hlos(model) -> tuple[str, str]:
    """The compiled decode and prefill steps' HLO text."""
    steps, caches = model.generation.steps(), model.kv.new_caches(2, 16)
    tokens, slots = np.zeros((2, 1), np.int32), np.arange(2, dtype=np.int32)
    decode = steps.decode.lower(model.state_leaves(), caches, tokens, np.ones((2, 1), bool), tokens, tokens)
    prompts = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    prefill = steps.prefill.lower(model.state_leaves(), caches, slots, prompts, prompts, slots, slots + 7)
    return decode.as_text(), prefill.as_text()


def test_generation_steps_call_it_where_the_plan_says(tmp_path):
    save_hf_model(make_hf_model("mixtral", seed=3), tmp_path)
    for dtype in ("bfloat16", "float32"):
        model = moe_jax.load_model(tmp_path, backend="host", dtype=dtype)
        assert model.plan.cache_attention
        assert all("moe_jax_cache_attention" in hlo for hlo in step_hlos(model))
    model = moe_jax.load_model(tmp_path, backend="host", dtype="bfloat16", xla_ffi=False)
    assert model.plan.reason("attention") == "XLA FFI handlers turned off by the caller"
    assert not any("moe_jax_cache_attention" in hlo for hlo in step_hlos(model))
