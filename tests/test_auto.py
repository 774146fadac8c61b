"""backend="auto": the planner's placement computes the same function as every other backend, the device expert
cache follows the routing inside its budget, and the memory split moves at run time without changing outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from moe_jax.backends import offload
from moe_jax.backends.placements import hybrid_layers
from moe_jax.generation.engine import GenerationEngine, Request
from moe_jax.planning.cost_model import Profile
from tests.hf_models import make_hf_model, save_hf_model
from tests.test_backends import lora_loss_grad

ROWS = np.array([1.0, 16.0, 256.0, 1024.0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    save_hf_model(make_hf_model("mixtral", seed=11), path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    return moe_jax.load_model(checkpoint, backend="device")


def expert_bytes(config):
    return 3 * config.hidden_size * config.expert_intermediate_size * 4


def profile(config, kind: str) -> Profile:
    """Synthetic machines: `bus` copies for free (the planner streams every routed expert), `host` has no bus
    to speak of (everything stays on the host), `mixed` copies one expert in the time of 30 host rows (some
    experts stream, the rest stay)."""
    nbytes = expert_bytes(config)
    copy_s = {"bus": 1e-9, "host": 1e3, "mixed": 3e-3}[kind]
    gbps = nbytes / copy_s / 1e9
    return Profile(nbytes, gbps, gbps, ROWS, ROWS * 1e-4, ROWS, ROWS * 1e-7, host_workers=1)


def load_auto(checkpoint, config, kind="mixed", cached_per_layer=2, **kwargs):
    """auto with room for the stream buffers (one top-k round, double-buffered) plus `cached_per_layer`."""
    eb = expert_bytes(config)
    budget = 2 * config.num_experts_per_tok * eb + cached_per_layer * eb * len(config.moe_layers)
    kwargs.setdefault("device_budget_bytes", budget)
    kwargs.setdefault("calibrate", False)  # these synthetic machines are not this one: test the planner as told
    return moe_jax.load_model(checkpoint, backend="auto", profile=profile(config, kind), **kwargs)


@pytest.fixture(scope="module")
def reference_lora_grad(reference):
    """Token ids, and the device backend's LoRA loss and gradients on them (once: its grouped products compile
    slowly on XLA:CPU)."""
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 11))
    return ids, lora_loss_grad(reference, jnp.asarray(ids))


@pytest.mark.parametrize("kind", ["bus", "host", "mixed"])
def test_auto_logits_and_lora_gradients_agree_with_the_device_backend(checkpoint, reference, reference_lora_grad, kind):
    ids, (ref_loss, ref_grad) = reference_lora_grad
    model = load_auto(checkpoint, reference.config, kind)
    np.testing.assert_allclose(model.logits(ids), reference.logits(ids), atol=1e-5)
    loss, grad = lora_loss_grad(model, jnp.asarray(ids))  # the same model, adapters attached now
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(got / scale, want / scale, atol=1e-5)


def test_mixed_placement_uses_cache_bus_and_host_in_one_call(checkpoint, reference, monkeypatch):
    copies = []
    monkeypatch.setattr(offload.TransferCounter, "record", lambda self, experts: copies.append(int(experts)))
    model = load_auto(checkpoint, reference.config, "mixed")
    ids = np.random.default_rng(1).integers(0, 96, size=(4, 16))
    model.logits(ids)
    jax.effects_barrier()
    host_pairs = sum(int(c.sum()) for c in model.metrics().tokens_per_expert.values())
    all_pairs = ids.size * reference.config.num_experts_per_tok * len(reference.config.moe_layers)
    assert sum(copies), "the planner streamed nothing"
    assert 0 < host_pairs < all_pairs  # the host computed some pairs, the device (cache + streams) the rest


def test_expert_cache_holds_the_most_routed_experts_within_its_budget(checkpoint, reference):
    config = reference.config
    ids = np.random.default_rng(2).integers(0, 96, size=(4, 16))
    host = moe_jax.load_model(checkpoint, backend="host")
    host.logits(ids)
    routed = host.metrics().tokens_per_expert
    model = load_auto(checkpoint, config, "mixed", cached_per_layer=2)
    cache = model.placement.expert_cache
    assert cache.capacity == 2
    model.calibrate_expert_cache(ids)
    for module in _layers(model):
        counts = routed[module.spec.layer]
        hottest = set(np.argsort(-counts, stable=True)[:2].tolist())
        assert set(module.cached) == hottest
    split = model.memory_split()
    assert split["experts_in_use"] <= model.device_budget_bytes
    assert cache.bytes_when_full + model.placement.stream_buffer_bytes <= model.device_budget_bytes
    np.testing.assert_allclose(model.logits(ids), reference.logits(ids), atol=1e-5)


def _layers(model):
    return hybrid_layers(model.transformer)


def test_memory_split_changes_mid_run_keep_outputs_identical_and_within_budget(checkpoint, reference):
    config = reference.config
    rng = np.random.default_rng(3)
    prompts = [rng.integers(8, 96, size=n).tolist() for n in (5, 9, 3, 12, 7, 4)]
    expected = reference.generate(prompts, max_new_tokens=6)
    model = load_auto(checkpoint, config, "mixed", cached_per_layer=3, kv_fraction=0.5)
    budget = model.device_budget_bytes
    seen = []

    def check(*_):
        split = model.memory_split()
        seen.append(split)
        assert split["kv_in_use"] + split["experts_in_use"] <= budget
        assert split["kv_in_use"] <= split["kv_budget"]

    outputs = []
    for kv_fraction, batch in ((0.5, prompts[:2]), (0.2, prompts[2:4]), (0.8, prompts[4:])):
        model.set_memory_split(kv_fraction=kv_fraction)
        check()
        engine = GenerationEngine(model, slots=4, max_len=32)
        done = engine.run([Request(p, 6) for p in batch], on_finish=check)
        outputs += [c.tokens for c in done]
    assert outputs == expected
    capacities = {s["experts_in_use"] for s in seen}
    assert len(capacities) >= 2  # the expert side really grew and shrank
    assert max(s["kv_in_use"] for s in seen) > 0


def test_kv_budget_limits_the_slots_and_a_too_small_one_is_refused(checkpoint, reference):
    model = load_auto(checkpoint, reference.config, "host", cached_per_layer=1)
    per_sequence = model.kv.bytes_per_sequence(32)
    model.set_memory_split(kv_bytes=2 * per_sequence)
    engine = GenerationEngine(model, slots=4, max_len=32)
    assert engine.slots_that_fit() == 2
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    done = engine.run([Request(p, 4) for p in prompts])
    assert [c.tokens for c in done] == reference.generate(prompts, max_new_tokens=4)
    model.set_memory_split(kv_bytes=per_sequence - 1)
    with pytest.raises(moe_jax.InputError, match="KV cache budget"):
        engine.run([Request([5, 6], 4)])


def test_bad_memory_splits_are_refused(checkpoint, reference):
    no_budget = moe_jax.load_model(checkpoint, backend="host")
    with pytest.raises(moe_jax.InputError, match="device_budget_bytes"):
        no_budget.set_memory_split(kv_fraction=0.5)
    model = load_auto(checkpoint, reference.config)
    with pytest.raises(moe_jax.InputError, match="kv_fraction must be in"):
        model.set_memory_split(kv_fraction=1.5)
    with pytest.raises(moe_jax.InputError, match="stream buffers"):
        model.set_memory_split(kv_fraction=1.0)  # nothing left for the stream buffers
    device = moe_jax.load_model(checkpoint, backend="device", device_budget_bytes=1000)
    with pytest.raises(moe_jax.InputError, match="does not fit"):
        device.set_memory_split(kv_fraction=0.1)


def test_auto_without_a_profile_measures_this_machine_once(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_JAX_CACHE", str(tmp_path))
    first = moe_jax.load_model(checkpoint, backend="auto")
    (path,) = tmp_path.glob("probe-*.json")
    stamp = path.stat().st_mtime_ns
    second = moe_jax.load_model(checkpoint, backend="auto")
    assert path.stat().st_mtime_ns == stamp  # read, not measured again
    assert first.placement.profile.bus_gbps == second.placement.profile.bus_gbps > 0
    np.testing.assert_array_equal(first.placement.profile.host_seconds, second.placement.profile.host_seconds)


def test_auto_keeps_every_expert_on_the_host_where_the_device_is_this_cpu(checkpoint, reference):
    """A profile measured with jax on the CPU (lanes share the cores, the device never faster): auto must
    not spend time or memory on a device copy."""
    from moe_jax.backends.host import HostExperts

    config = reference.config
    cpu = Profile(expert_bytes(config), 5.0, 3.0, ROWS, ROWS * 1e-5, ROWS, ROWS * 1e-4, parallel_lanes=False)
    model = moe_jax.load_model(checkpoint, backend="auto", profile=cpu, device_budget_bytes=10**8, calibrate=False)
    assert not _layers(model) and model.memory_split()["experts_in_use"] == 0
    assert any(isinstance(m, HostExperts) for _, m in nnx.iter_graph(model.transformer))
    ids = np.random.default_rng(4).integers(0, 96, size=(2, 9))
    np.testing.assert_allclose(model.logits(ids), reference.logits(ids), atol=1e-5)


def test_training_steps_use_the_cache_as_refreshed_between_them(checkpoint, reference):
    """The objective reads the frozen weights at each call: after the cache changes (values only, or resized by a
    memory split) the next step computes with it, and the loss and gradients stay those of the device backend."""
    from moe_jax.model.lora import LoRAConfig
    from moe_jax.train.objective import lora_value_and_grad

    tokens = np.random.default_rng(5).integers(0, 96, size=(2, 12)).astype(np.int32)
    mask = np.ones_like(tokens)
    device = moe_jax.load_model(checkpoint, backend="device")  # not the shared fixture: adapters get attached
    device.attach_lora(LoRAConfig(rank=4, alpha=8), seed=3)
    device_step, device_lora = lora_value_and_grad(device)
    want_loss, want_grads = device_step(device_lora, tokens, mask)
    # experts' share: stream buffers + 2 cached per layer; the KV cache holds room for one more per layer
    model = load_auto(checkpoint, reference.config, "mixed", cached_per_layer=3, kv_fraction=0.2)
    assert model.placement.expert_cache.capacity == 2
    model.attach_lora(LoRAConfig(rank=4, alpha=8), seed=3)
    step, lora_state = lora_value_and_grad(model)
    caches = []
    for change in (None, "refresh", "split"):
        if change == "refresh":
            model.calibrate_expert_cache(tokens)
        elif change == "split":
            model.set_memory_split(kv_bytes=0)  # the KV share goes to the experts: one more cached per layer
        loss, grads = step(lora_state, tokens, mask)
        caches.append([m.cached for m in _layers(model)])
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()) + 1e-7)
    assert caches[0] != caches[1] or caches[1] != caches[2]  # the cache really changed between steps
    assert all(len(c) == 3 for c in caches[2])


def tiny_device_profile(config, parallel_lanes=False) -> Profile:
    """A device that wins at 1 row (2x) and loses 4x from 16 rows on, sharing the host's cores (jax on CPU,
    measured on a lucky run) unless `parallel_lanes`."""
    host = ROWS * 1e-4
    device = np.where(ROWS <= 1, 0.5, 4.0) * host
    nbytes = expert_bytes(config)
    return Profile(nbytes, 5.0, 3.0, ROWS, host, ROWS, device, host_workers=1, parallel_lanes=parallel_lanes)


def _host_pairs(model) -> int:
    jax.effects_barrier()
    return sum(int(c.sum()) for c in model.metrics().tokens_per_expert.values())


def test_cached_experts_are_an_option_per_call_not_an_obligation(checkpoint, reference):
    """Every expert cached, a device that wins only at 1 row: a call of ~256 rows an expert sends every pair to
    the host; a one-token call computes from the cache; both give the host backend's outputs."""
    config = reference.config
    model = moe_jax.load_model(
        checkpoint,
        backend="auto",
        profile=tiny_device_profile(config),
        device_budget_bytes=(config.num_experts * len(config.moe_layers) + 4) * expert_bytes(config),
        calibrate=False,  # the synthetic device, as told, not this machine's
    )  # room for every expert and the 2 x 2 stream buffers
    assert model.placement.uses_device and model.placement.expert_cache.capacity == config.num_experts
    host = moe_jax.load_model(checkpoint, backend="host")
    layers = len(config.moe_layers)
    big = np.random.default_rng(6).integers(0, 96, size=(2, 256))  # 2 x 256 tokens x top-2 / 4 experts
    model.metrics()
    np.testing.assert_allclose(model.logits(big), host.logits(big), atol=1e-5)
    assert _host_pairs(model) == big.size * config.num_experts_per_tok * layers
    one = np.array([[17]])
    model.metrics()
    np.testing.assert_allclose(model.logits(one), host.logits(one), atol=1e-5)
    assert _host_pairs(model) == 0  # both routed experts computed from the cache


def test_auto_stays_host_only_when_the_device_is_not_clearly_faster(checkpoint, reference):
    """jax on this CPU measured 10% faster than the host at 1 row (the noise between two probes): no cache."""
    config = reference.config
    noisy = Profile(
        expert_bytes(config), 5.0, 3.0, ROWS, ROWS * 1e-4, ROWS, ROWS * 0.9e-4, host_workers=1, parallel_lanes=False
    )
    assert not noisy.device_helps
    model = moe_jax.load_model(checkpoint, backend="auto", profile=noisy, device_budget_bytes=10**8, calibrate=False)
    assert not model.placement.uses_device and not _layers(model)
    assert "host only" in model.placement.describe()


def test_auto_stays_host_only_where_the_device_call_costs_more_than_it_saves(checkpoint, reference):
    """Faster per expert at 1-4 rows, but with a fixed cost per call (as jax on CPU measures, ~1.7 ms) that
    every phase pays: the rule predicts no gain, so auto builds host layers and says why."""
    config = reference.config
    base = tiny_device_profile(config)
    costly = Profile(**{**base.__dict__, "device_call_s": 2e-3})
    model = moe_jax.load_model(checkpoint, backend="auto", profile=costly, device_budget_bytes=10**8, calibrate=False)
    assert not model.placement.uses_device and not _layers(model)
    assert "below" in model.placement.auto_choice.reason


AGREEMENT_PROFILES = ["bus", "host", "mixed", "tiny-device-shared", "tiny-device-parallel", "measured", "costly"]


@pytest.mark.parametrize("kind", AGREEMENT_PROFILES)
def test_advisor_and_auto_agree(checkpoint, reference, kind):
    """The advisor asked about auto's phases predicts what the auto backend builds: the device cache exactly
    where the advisor's auto beats its host prediction by WORTH_IT somewhere, and auto never recommended
    where it is host layers alone."""
    from moe_jax.planning.advise import advise
    from moe_jax.planning.auto_choice import PHASES, WORTH_IT
    from moe_jax.planning.model_shape import model_shape, step_shape

    config = reference.config
    if kind in ("bus", "host", "mixed"):
        p = profile(config, kind)
    elif kind == "measured":
        p = Profile.load("tests/data/probe_2core_cpu.json")
        p = Profile(**{**p.__dict__, "expert_bytes": float(expert_bytes(config))})
    else:
        p = tiny_device_profile(config, parallel_lanes=kind == "tiny-device-parallel")
        if kind == "costly":
            p = Profile(**{**p.__dict__, "device_call_s": 2e-3})
    eb = expert_bytes(config)
    budget = 2 * config.num_experts_per_tok * eb + 2 * eb * len(config.moe_layers)
    model = moe_jax.load_model(checkpoint, backend="auto", profile=p, device_budget_bytes=budget, calibrate=False)
    answer = advise(p, model_shape(config, 4), PHASES, device_memory=budget, step=step_shape(config, 4))
    assert answer["auto"]["use_device"] == model.placement.uses_device
    gains = [row["options"]["host"]["step_s"] / row["options"]["auto"]["step_s"] for row in answer["rows"]]
    assert model.placement.uses_device == (max(gains) >= WORTH_IT)
    if not p.parallel_lanes:  # (beside an accelerator host layers may pipeline, auto's hybrid layers do not)
        assert min(gains) >= 1.0 - 1e-9  # the planner never predicts auto slower than the host alone
    if not model.placement.uses_device:
        assert all(row["recommend"] != "auto" for row in answer["rows"])


def test_calibration_uses_the_host_path_where_it_measures_faster(checkpoint, reference, monkeypatch):
    """A profile whose device wins at 1 row: the one-token phase is timed on a real layer at load; where the host
    path measured faster, one-token calls trace it (no planner, no cache) and give the host backend's outputs."""
    from moe_jax.backends import calibrate

    config = reference.config
    budget = (config.num_experts * len(config.moe_layers) + 4) * expert_bytes(config)
    measured = moe_jax.load_model(
        checkpoint, backend="auto", profile=tiny_device_profile(config), device_budget_bytes=budget
    )
    timings = measured.placement.calibration
    assert 1 in timings and all(host > 0 and device > 0 for host, device in timings.values())
    assert measured.placement.host_phases == {t for t, (host, device) in timings.items() if host <= device}
    assert "1 tokens measured host" in measured.placement.describe()

    monkeypatch.setattr(calibrate, "host_faster_phases", lambda layer, dtype: (frozenset({1}), {1: (1e-4, 2e-4)}))
    model = moe_jax.load_model(
        checkpoint, backend="auto", profile=tiny_device_profile(config), device_budget_bytes=budget
    )
    assert not model.placement.cache_in_use and "(host path used)" in model.placement.describe()
    host = moe_jax.load_model(checkpoint, backend="host")
    one = np.random.default_rng(8).integers(0, 96, size=(1, 1))
    model.metrics()
    np.testing.assert_allclose(model.logits(one), host.logits(one), atol=1e-5)
    assert _host_pairs(model) == config.num_experts_per_tok * len(config.moe_layers)  # every pair on the host
