"""The device/host micro-batch pipeline (backends/pipeline.py, Transformer.pipelined): the same logits, losses,
LoRA gradients and generations as the plain pass, for every family and every backend with a host lane; its
callbacks run in the ping-pong order, forward and backward; the plan keeps it off where jax's device is this CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from host_kernels import HostKernelError
from moe_jax import doctor
from moe_jax.backends.lane_timeline import LaneTimeline
from moe_jax.errors import InputError
from moe_jax.model.lora import LoRAConfig
from moe_jax.model.transformer import micro_batch_bounds
from moe_jax.planning import plan as plan_module
from moe_jax.planning.plan import make_plan
from moe_jax.train.objective import lora_value_and_grad
from tests.hf_models import make_hf_model, save_hf_model
from tests.test_auto import ROWS, profile
from tests.test_backends import half_plan, lora_loss_grad, randomized

# the families' distinct parts: plain (mixtral), shared experts with a gate (qwen2_moe), q/k norms (qwen3_moe),
# latent attention with a dense first layer and grouped routing (deepseek_v3)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return request.param, save_hf_model(make_hf_model(request.param, seed=11), tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_hf_model(make_hf_model("mixtral", seed=11), tmp_path_factory.mktemp("mixtral"))


def outputs(model, rows_logits=5, rows_loss=3):
    """Logits of `rows_logits` rows and the LoRA loss and gradients (attention and expert adapters, random B)
    of `rows_loss` rows: odd counts, so micro-batches differ in size."""
    ids = np.random.default_rng(0).integers(0, 96, size=(rows_logits, 11))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, size=(rows_loss, 10)))
    return model.logits(ids), *lora_loss_grad(model, tokens)


def assert_same(got, want):
    logits, loss, grads = got
    np.testing.assert_allclose(logits, want[0], atol=1e-5)
    np.testing.assert_allclose(loss, want[1], rtol=1e-5)
    leaves = jax.tree.leaves(want[2])
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)
    for g, w in zip(jax.tree.leaves(grads), leaves, strict=True):
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(g / scale, w / scale, atol=1e-5)


def test_micro_batch_bounds():
    assert micro_batch_bounds(5, 2) == [(0, 3), (3, 5)]
    assert micro_batch_bounds(3, 4) == [(0, 1), (1, 2), (2, 3)]  # no empty micro-batch
    assert micro_batch_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert micro_batch_bounds(1, 2) == [(0, 1)]


def test_every_family_pipelined_equals_the_plain_pass(family):
    name, path = family
    plain = outputs(moe_jax.load_model(path, backend="host", pipeline=1))
    for micro_batches in (2, 4) if name == "mixtral" else (2,):  # 4: 5 rows as 2+1+1+1, 3 rows as 1+1+1
        model = moe_jax.load_model(path, backend="host", pipeline=micro_batches)
        assert model.plan.micro_batches == micro_batches
        assert_same(outputs(model), plain)


@pytest.mark.parametrize("backend", ["hybrid", "auto"])
def test_other_host_lane_backends_pipelined_equal_the_plain_pass(mixtral, backend):
    """hybrid (half the experts cached: its layers compute at `start`, device and host shares overlapped inside
    the call) and auto where it keeps host layers (a machine without a usable bus), which pipeline."""
    config = moe_jax.load_model(mixtral, backend="device").config

    def load(pipeline):
        if backend == "hybrid":
            return moe_jax.load_model(mixtral, backend="hybrid", device_experts=half_plan(config), pipeline=pipeline)
        slow_device = dataclasses.replace(profile(config, "host"), device_seconds=ROWS * 1e-2)
        model = moe_jax.load_model(mixtral, backend="auto", profile=slow_device, calibrate=False, pipeline=pipeline)
        assert not model.placement.uses_device
        return model

    assert_same(outputs(load(2)), outputs(load(1)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generation_pipelined_equals_the_plain_pass(mixtral, dtype):
    """Prefill and decode steps over the KV cache, each micro-batch's rows written back into it (in bfloat16 with
    the native cache attention and dense products where this CPU runs them)."""
    prompts = [[3, 4, 5, 6], [7], [8, 9], [10, 11, 12]]
    plain = moe_jax.load_model(mixtral, backend="host", pipeline=1, dtype=dtype)
    piped = moe_jax.load_model(mixtral, backend="host", pipeline=2, dtype=dtype)
    assert piped.generate(prompts, max_new_tokens=6) == plain.generate(prompts, max_new_tokens=6)
    sampled = dict(max_new_tokens=6, temperature=0.9, seed=3)
    assert piped.generate(prompts, **sampled) == plain.generate(prompts, **sampled)


@pytest.mark.parametrize("variant", ["qwen2_moe", "deepseek_v3"])  # shared experts; + a dense layer, latent attention
def test_lora_dropout_drops_the_same_inputs_pipelined(variant, tmp_path):
    """Each micro-batch takes its rows of the whole batch's dropout masks (the 2-D inputs of shared experts and
    dense MLPs too): the pipelined step's loss and gradients with dropout are the plain step's."""
    path = save_hf_model(make_hf_model(variant, seed=11), tmp_path)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, size=(3, 10)))
    mask = jnp.ones_like(tokens)
    key = jax.random.key(7)
    results = []
    for pipeline in (1, 2):
        model = moe_jax.load_model(path, backend="host", pipeline=pipeline)
        model.attach_lora(
            LoRAConfig(rank=4, alpha=8, targets=("attention", "gate_proj", "up_proj", "down_proj"), dropout=0.3), seed=0
        )
        value_and_grad, lora_state = lora_value_and_grad(model)
        state = randomized(lora_state, 1)
        results.append(value_and_grad(state, tokens, mask, key))
        if pipeline == 1:  # without dropout: one step is enough to see that dropout changes the loss
            plain = value_and_grad(state, tokens, mask)
    dropped, piped = results
    assert float(dropped[0]) != pytest.approx(float(plain[0]), rel=1e-4)  # dropout changes the loss
    np.testing.assert_allclose(piped[0], dropped[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(piped[1]), jax.tree.leaves(dropped[1]), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5 * float(jnp.abs(w).max()))


def test_decode_steps_follow_their_own_count(mixtral, monkeypatch):
    """The default beside an accelerator: prefill and training steps split, decode steps plain."""
    monkeypatch.setattr(plan_module, "pipeline_choice", lambda asked, host_lane: (2, 1, "as an accelerator's"))
    model = moe_jax.load_model(mixtral, backend="host")
    assert (model.plan.micro_batches, model.plan.decode_micro_batches) == (2, 1)
    assert "micro-batch pipeline: 2 micro-batches, decode steps off" in "\n".join(model.plan.lines())
    timeline = LaneTimeline()
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    with timeline.recording(model.placement.runtime):
        piped = model.generate(prompts, max_new_tokens=5)
    calls = [e.label for e in timeline.events if e.lane == "host"]
    # the prompts' prefill only (one step of 3 rows, 2 micro-batches, 2 MoE layers); no decode step called back
    assert sorted(calls) == sorted(("forward", layer, m) for layer in (0, 1) for m in (0, 1))
    assert piped == moe_jax.load_model(mixtral, backend="host", pipeline=1).generate(prompts, max_new_tokens=5)


def callback_order(timeline):
    return [e.label for e in sorted(timeline.events, key=lambda e: e.start) if e.lane == "callback"]


def test_callbacks_ping_pong_forward_and_backward(mixtral):
    """Two MoE layers, two micro-batches: each finish waits until the next micro-batch was started, so the device
    computes that one's attention while the host computes; the backward mirrors it, last layer first."""
    model = moe_jax.load_model(mixtral, backend="host", pipeline=2)
    assert tuple(model.config.moe_layers) == (0, 1)
    runtime = model.placement.runtime
    ids = np.random.default_rng(0).integers(0, 96, size=(4, 11))
    timeline = LaneTimeline()
    with timeline.recording(runtime):
        model.logits(ids)
    forward = [
        ("submit forward", 0, 0),
        ("submit forward", 0, 1),
        ("collect forward", 0, 0),
        ("submit forward", 1, 0),
        ("collect forward", 0, 1),
        ("submit forward", 1, 1),
        ("collect forward", 1, 0),
        ("collect forward", 1, 1),
    ]
    assert callback_order(timeline) == forward
    assert [e.label for e in timeline.events if e.lane == "host"] == [
        ("forward", 0, 0),
        ("forward", 0, 1),
        ("forward", 1, 0),
        ("forward", 1, 1),
    ]
    timeline = LaneTimeline()
    with timeline.recording(runtime):
        jax.block_until_ready(lora_loss_grad(model, jnp.asarray(ids)))
    order = callback_order(timeline)
    assert order[:8] == [(kind.replace("submit forward", "submit forward_keeping"), *at) for kind, *at in forward]
    assert order[8:] == [
        ("submit backward", 1, 1),
        ("submit backward", 1, 0),
        ("collect backward", 1, 1),
        ("submit backward", 0, 1),
        ("collect backward", 1, 0),
        ("submit backward", 0, 0),
        ("collect backward", 0, 1),
        ("collect backward", 0, 0),
    ]
    opening = [e.label for e in timeline.events if e.lane == "callback" and e.opens_pass]
    assert sorted(opening) == [("submit backward", 1, 1), ("submit forward_keeping", 0, 0)]
    summary = timeline.summary()
    assert summary["host_calls"] == 8 and summary["host_busy_s"] > 0 and summary["device_busy_s"] > 0
    assert 0 <= summary["both_busy_s"] <= min(summary["host_busy_s"], summary["device_busy_s"])
    assert len(timeline.device_intervals()) == 14  # between the 8 callbacks of each pass


def test_lane_overlap_arithmetic():
    timeline = LaneTimeline()
    timeline.add("host", ("forward", 0, 0), 1.0, 3.0)
    timeline.add("host", ("forward", 0, 1), 4.0, 5.0)
    for start, end, opens in ((0.0, 0.5, True), (1.5, 2.0, False), (4.5, 6.0, False)):
        timeline.add("callback", ("c",), start, end, opens)
    assert timeline.device_intervals() == [(0.5, 1.5), (2.0, 4.5)]
    summary = timeline.summary()
    assert summary["host_busy_s"] == 3.0 and summary["device_busy_s"] == 3.5
    assert summary["both_busy_s"] == pytest.approx(0.5 + 1.0 + 0.5)  # [1, 1.5], [2, 3], [4, 4.5]


def test_a_host_failure_in_a_pipelined_step_surfaces_and_leaves_nothing_broken(mixtral, monkeypatch):
    model = moe_jax.load_model(mixtral, backend="host", pipeline=2)
    compute = model.placement.runtime.compute
    original = compute.forward

    def failing(layer, *args, **kwargs):
        if layer == 1:
            raise HostKernelError(f"layer {layer}: simulated failure")
        return original(layer, *args, **kwargs)

    monkeypatch.setattr(compute, "forward", failing)
    with pytest.raises(HostKernelError, match="layer 1: simulated failure"):
        model.logits(np.ones((2, 4), np.int64))
    monkeypatch.undo()
    assert model.logits(np.ones((2, 4), np.int64)).shape == (2, 4, 96)


def test_the_plan_keeps_the_pipeline_off_where_the_device_is_this_cpu(mixtral, monkeypatch, capsys):
    monkeypatch.delenv("MOE_JAX_PIPELINE", raising=False)
    plan = make_plan("float32", np.float32)
    assert jax.default_backend() == "cpu" and plan.micro_batches == 1
    assert "this CPU" in plan.reason("pipeline")
    assert make_plan("float32", None).reason("pipeline") == "no host lane"
    monkeypatch.setenv("MOE_JAX_PIPELINE", "4")
    asked = make_plan("float32", np.float32)
    assert (asked.micro_batches, asked.decode_micro_batches) == (4, 4)  # asked for: every kind of step
    assert make_plan("float32", np.float32, pipeline=1).micro_batches == 1  # the caller's word over the variable
    monkeypatch.setenv("MOE_JAX_PIPELINE", "two")
    with pytest.raises(InputError, match="MOE_JAX_PIPELINE must be a whole number"):
        make_plan("float32", np.float32)
    monkeypatch.delenv("MOE_JAX_PIPELINE")
    with pytest.raises(InputError, match="at least 1"):
        moe_jax.load_model(mixtral, backend="host", pipeline=0)
    assert any("pipeline: off (jax's device is this CPU" in line for line in plan.lines())
    doctor.main([])
    assert "device/host micro-batch pipeline: off" in capsys.readouterr().out
