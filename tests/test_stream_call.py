"""The stream-ordered host expert calls inside jitted steps (moe_jax/native/stream_experts.py), here on XLA:CPU,
whose submit/sync handlers drive the same host worker the CUDA handlers drive beside a GPU: the same bits as the
direct FFI handler, plain and pipelined (submit and sync split around the other micro-batch's attention), the same
losses and LoRA gradients, errors by layer, and the plan's choice of host call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from host_kernels import choose_kernels
from moe_jax import doctor
from moe_jax.errors import InputError
from moe_jax.model.lora import LoRAConfig, split_trainable
from moe_jax.native import stream_experts
from moe_jax.planning.plan import CALLBACK, FFI, STREAM, host_call_choice, make_plan
from tests.hf_models import make_hf_model, save_hf_model
from tests.test_backends import randomized
from tests.test_pipeline import assert_same, outputs

KERNELS = choose_kernels(np.dtype(np.float32))
pytestmark = pytest.mark.skipif(not KERNELS.fused, reason="no fused forward kernel for float32 experts here")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_hf_model(make_hf_model("mixtral", seed=11), tmp_path_factory.mktemp("mixtral"))


def hlo(model, rows=2, length=7):
    ids = np.zeros((rows, length), np.int32)
    return model._forward_jit.lower(model.state, ids, np.zeros(ids.shape, np.int32)).as_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stream_calls_give_the_direct_handlers_bits(mixtral, dtype):
    ffi = moe_jax.load_model(mixtral, backend="host", dtype=dtype, host_call=FFI)
    stream = moe_jax.load_model(mixtral, backend="host", dtype=dtype, host_call=STREAM)
    if not stream.placement.runtime.compute.fused:
        pytest.skip(f"no fused forward for {dtype} experts here")
    assert stream.plan.host_call == STREAM and ffi.plan.host_call == FFI
    text = hlo(stream)
    assert stream_experts.SUBMIT in text and stream_experts.SYNC in text and "moe_jax_host_experts" not in text
    ids = np.random.default_rng(0).integers(0, 96, size=(3, 11))
    np.testing.assert_array_equal(stream.logits(ids), ffi.logits(ids))
    prompts = [[5, 9, 2], [7, 1, 1, 3, 8]]
    assert stream.generate(prompts, max_new_tokens=6) == ffi.generate(prompts, max_new_tokens=6)
    counters = stream.placement.runtime.stream.counters()
    assert counters["calls"] > 0 and counters["failed"] == 0


def test_pipelined_stream_calls_equal_the_plain_pass(mixtral):
    plain = outputs(moe_jax.load_model(mixtral, backend="host", pipeline=1, host_call=FFI))
    model = moe_jax.load_model(mixtral, backend="host", pipeline=2, host_call=STREAM)
    text = hlo(model, rows=5)
    # every MoE layer's two micro-batches: a submit and a sync each, no callback left in the forward
    layers = len(model.config.moe_layers)
    assert text.count(f"custom_call @{stream_experts.SUBMIT}(") == 2 * layers
    assert text.count(f"custom_call @{stream_experts.SYNC}(") == 2 * layers
    assert "callback" not in text
    assert_same(outputs(model), plain)  # logits, and the loss and LoRA gradients (callbacks under differentiation)


def test_generation_pipelined_on_stream_calls(mixtral):
    prompts = [[5, 9, 2], [7, 1, 1, 3, 8], [4, 4], [1, 2, 3, 4, 5, 6]]
    plain = moe_jax.load_model(mixtral, backend="host", host_call=FFI).generate(prompts, max_new_tokens=5)
    model = moe_jax.load_model(mixtral, backend="host", pipeline=2, host_call=STREAM)
    assert model.generate(prompts, max_new_tokens=5) == plain


def attention_lora_loss(model, tokens):
    """(jitted value_and_grad of the LM loss in the attention LoRA state, that state, randomized): no expert
    adapters, so the experts' forward and backward may take the stream calls."""
    model.attach_lora(LoRAConfig(rank=4, alpha=8, targets=("attention",)), seed=0)
    model.prepare_for_training()  # packs the fused backward's layers
    graphdef, lora_state, rest = split_trainable(model.transformer)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def loss(lora_state):
        logits, _ = nnx.merge(graphdef, lora_state, rest)(tokens[:, :-1], positions[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss)), randomized(lora_state, 1)


def test_training_steps_take_the_stream_calls(mixtral):
    # bfloat16 experts (the fused backward's kernels): the training forward keeps its pre-activations in its
    # stream site and the backward reads them there, no callback in the step; loss and LoRA gradients equal the
    # direct handler's model, whose training forward and backward are callbacks into the same native code
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, size=(3, 10)))
    stream = moe_jax.load_model(mixtral, backend="host", dtype="bfloat16", host_call=STREAM)
    if stream.placement.runtime.call_kind(lora=None, training=True) != STREAM:
        pytest.skip("no fused backward for bfloat16 experts here (the training step keeps its callbacks)")
    ffi = moe_jax.load_model(mixtral, backend="host", dtype="bfloat16", host_call=FFI)
    step, state = attention_lora_loss(stream, tokens)
    text = step.lower(state).as_text()
    assert "callback" not in text
    assert text.count(f"custom_call @{stream_experts.SUBMIT}(") == 2 * len(stream.config.moe_layers)  # fwd, bwd
    loss, grads = step(state)
    want_loss, want_grads = attention_lora_loss(ffi, tokens)[0](state)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    leaves = jax.tree.leaves(want_grads)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)
    for g, w in zip(jax.tree.leaves(grads), leaves, strict=True):
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w, np.float32) / scale, atol=1e-5)
    assert stream.placement.runtime.stream.counters()["failed"] == 0


def test_a_backward_naming_no_keeping_forward_is_refused(mixtral):
    model = moe_jax.load_model(mixtral, backend="host", dtype="bfloat16", host_call=STREAM)
    runtime = model.placement.runtime
    if runtime.call_kind(lora=None, training=True) != STREAM:
        pytest.skip("no fused backward for bfloat16 experts here")
    model.prepare_for_training()
    forward, backward = runtime.stream_call(0), runtime.stream_call(0, "backward")
    hidden = model.config.hidden_size
    x, ids = jnp.ones((2, hidden), jnp.bfloat16), jnp.zeros((2, 2), jnp.int32)
    weights = jnp.full((2, 2), 0.5, jnp.float32)

    def step(x):
        ticket = stream_experts.submit(forward, x, ids, weights)  # a plain forward: it keeps nothing
        y, done = stream_experts.sync(forward, ticket, x, weights)
        dy = y.astype(jnp.float32)
        submitted = stream_experts.submit(backward, dy, ids, weights, forward_ticket=done)
        return stream_experts.sync(backward, submitted, dy, weights)[0]

    with pytest.raises(Exception, match="names no keeping forward"):
        jax.block_until_ready(jax.jit(step)(x))


def test_a_backward_after_its_forward_ran_again_is_refused(mixtral):
    # a keeping forward's site holds the pre-activations of its last call: a backward of an earlier call would
    # read another call's, so it is refused by name (the answered ticket names the call)
    model = moe_jax.load_model(mixtral, backend="host", dtype="bfloat16", host_call=STREAM)
    runtime = model.placement.runtime
    if runtime.call_kind(lora=None, training=True) != STREAM:
        pytest.skip("no fused backward for bfloat16 experts here")
    model.prepare_for_training()
    forward, backward = runtime.stream_call(0, "forward-keeping"), runtime.stream_call(0, "backward")
    x = jnp.ones((2, model.config.hidden_size), jnp.bfloat16)
    ids, weights = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.full((2, 2), 0.5, jnp.float32)

    def step(x, again: bool):
        y, first = stream_experts.sync(forward, stream_experts.submit(forward, x, ids, weights), x, weights)
        after = None
        if again:  # the same site again, on other inputs, before the first call's backward (`after` orders it)
            _, second = stream_experts.sync(forward, stream_experts.submit(forward, 2 * y, ids, weights), x, weights)
            after = second.astype(jnp.float32)
        dy = jnp.ones(x.shape, jnp.float32)
        submitted = stream_experts.submit(backward, dy, ids, weights, after=after, forward_ticket=first)
        return stream_experts.sync(backward, submitted, dy, weights)[0]

    assert np.isfinite(np.asarray(jax.jit(step, static_argnums=1)(x, False))).all()
    with pytest.raises(Exception, match="overwritten"):
        jax.block_until_ready(jax.jit(step, static_argnums=1)(x, True))


def test_a_failed_stream_call_names_its_layer(mixtral):
    model = moe_jax.load_model(mixtral, backend="host", host_call=STREAM)
    runtime = model.placement.runtime
    site = runtime.stream_call(1)
    x = jnp.ones((3, model.config.hidden_size), jnp.float32)
    weights = jnp.ones((3, 2), jnp.float32)

    def late_sync(x, ids):
        """The sync after other work that needs the ticket: the worker has failed before the sync starts."""
        ticket = stream_experts.submit(site, x, ids, weights)
        busy = jnp.linalg.matrix_power(jnp.eye(256) * 1.001 + ticket.astype(jnp.float32) * 0, 64).sum()
        return stream_experts.sync(site, ticket, x, weights, after=busy)[0]

    bad_ids = jnp.full((3, 2), 1000, jnp.int32)  # no such expert
    with pytest.raises(Exception, match="layer 1") as failure:
        jax.block_until_ready(jax.jit(late_sync)(x, bad_ids))
    assert "1000" in str(failure.value)
    # the sync took its call's error and reset its slot: the model's own steps run on and agree with the direct
    # handler (a sync that refused on the error it found kept instead left it for the next submit to fail on)
    ids = np.random.default_rng(3).integers(0, 96, size=(2, 9))
    ffi = moe_jax.load_model(mixtral, backend="host", host_call=FFI)
    np.testing.assert_array_equal(model.logits(ids), ffi.logits(ids))
    assert runtime.stream.counters()["failed"] == 1


def test_the_plan_chooses_the_host_call_and_says_why(mixtral, monkeypatch):
    model = moe_jax.load_model(mixtral, backend="host")
    assert model.plan.host_call == FFI  # on XLA:CPU the direct handler
    assert "directly" in model.plan.reason("host call")
    assert any(line.startswith("host experts called: through XLA FFI") for line in model.plan.lines())
    assert host_call_choice(None, fused=False) == (CALLBACK, "no fused forward to call")
    assert host_call_choice(None, fused=True, turned_off="MOE_JAX_XLA_FFI=0") == (CALLBACK, "MOE_JAX_XLA_FFI=0")
    assert host_call_choice(CALLBACK, fused=True)[0] == CALLBACK  # selectable, to compare against
    assert make_plan("float32", np.float32, host_call=STREAM).host_call == STREAM
    with pytest.raises(InputError, match="XLA FFI handlers turned off"):
        make_plan("float32", np.float32, xla_ffi=False, host_call=STREAM)
    with pytest.raises(InputError, match="host call must be one of"):
        make_plan("float32", np.float32, host_call="rpc")
    monkeypatch.setenv("MOE_JAX_HOST_CALL", STREAM)
    assert make_plan("float32", np.float32).host_call == STREAM
    monkeypatch.setenv("MOE_JAX_HOST_CALL", "carrier-pigeon")
    with pytest.raises(InputError, match="MOE_JAX_HOST_CALL"):
        make_plan("float32", np.float32)


def test_doctor_reports_the_stream_calls():
    report = doctor.report()
    assert report["native_libraries"]["stream_handlers"] == "ok"
    assert report["native_libraries"]["cuda_stream_handlers"]  # here: why not (no driver), never empty
    assert all(p["host_call"] in (FFI, STREAM, CALLBACK) for p in report["plans"].values())
