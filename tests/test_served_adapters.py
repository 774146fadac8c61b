"""Per-request LoRA adapters (Model.serve_adapters, model/served_adapters.py): each served adapter gives what the
model with that adapter loaded gives, a batch mixing adapters gives each row what it gets alone, and rows without
one get the base model's; the anchor cache keeps each adapter's KV apart. The server's side is in
tests/test_serve_adapters.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import moe_jax
from bench.models import random_adapter
from moe_jax.errors import CheckpointError, InputError
from moe_jax.generation.anchor_cache import AnchorCache
from moe_jax.generation.batch import Job
from moe_jax.generation.engine import GenerationEngine, Request

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "tiny-moe"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3] * 7, [40, 41, 42, 43], [9, 7, 5, 3, 1, 2]]
MIX = ["a", "b", None, "a", "b"]
NEW = 12


@pytest.fixture(scope="module")
def adapters(bundled_adapters):
    return bundled_adapters


def alone(model_dir, adapters, dtype="float32", **sampling) -> dict:
    """{adapter name or None: outputs for PROMPTS} of the model loaded with that adapter (or none)."""
    out = {}
    for name in (None, *adapters):
        model = moe_jax.load_model(model_dir, dtype=dtype, adapter=adapters[name] if name else None)
        out[name] = model.generate(PROMPTS, max_new_tokens=NEW, **sampling)
    return out


def mixed_equals_alone(served, reference, **sampling):
    out = served.generate(PROMPTS, max_new_tokens=NEW, adapter=MIX, **sampling)
    assert out == [reference[name][i] for i, name in enumerate(MIX)]


def test_each_served_adapter_equals_the_model_loading_it_and_a_mixed_batch_equals_each_alone(adapters):
    reference = alone(BUNDLED, adapters)
    assert reference["a"] != reference[None] and reference["b"] != reference["a"]  # the adapters change outputs
    served = moe_jax.load_model(BUNDLED, adapters=adapters)
    assert served.served_adapters == ("a", "b")
    for name in (None, "a", "b"):
        assert served.generate(PROMPTS, max_new_tokens=NEW, adapter=name) == reference[name]
    mixed_equals_alone(served, reference)
    # greedy batches run in blocks of steps on the device (the above); one step a call must agree
    engine = GenerationEngine(served, len(PROMPTS), 32, block_steps=1)
    requests = [Request(p, NEW, adapter=served.adapter_index(a)) for p, a in zip(PROMPTS, MIX, strict=True)]
    completions = engine.run(requests, eos_ids=served.config.eos_token_ids)
    assert [c.tokens for c in completions] == [reference[name][i] for i, name in enumerate(MIX)]
    # and speculative steps, each row's drafts verified through its own adapter
    engine = GenerationEngine(served, len(PROMPTS), 32, drafts=3, draft_policy="always")
    completions = engine.run(requests, eos_ids=served.config.eos_token_ids)
    assert [c.tokens for c in completions] == [reference[name][i] for i, name in enumerate(MIX)]
    assert engine.stats.accepted_tokens > 0


def test_sampled_rows_with_adapters_equal_each_alone(adapters):
    sampling = {"temperature": 1.0, "seed": 7}
    mixed_equals_alone(moe_jax.load_model(BUNDLED, adapters=adapters), alone(BUNDLED, adapters, **sampling), **sampling)


def test_micro_batched_steps_take_their_rows_adapters(adapters):
    served = moe_jax.load_model(BUNDLED, adapters=adapters, pipeline=2)
    assert served.plan.micro_batches == 2
    mixed_equals_alone(served, alone(BUNDLED, adapters))


def first_logits(model, adapter_names) -> np.ndarray:
    """The next-token logits after each prompt of PROMPTS (a prefill through the engine), each row through its
    served adapter."""
    engine = model.engine(len(PROMPTS), 32)
    jobs = [Job(Request(p, 4, adapter=model.adapter_index(a))) for p, a in zip(PROMPTS, adapter_names, strict=True)]
    with engine.batch(len(PROMPTS)) as batch:
        _, _, logits = engine.prefill(batch.caches, list(enumerate(jobs)))
    return logits


def test_bfloat16_served_adapters_agree_with_loaded_ones_to_its_rounding(adapters):
    served = moe_jax.load_model(BUNDLED, dtype="bfloat16", adapters=adapters)
    mixed = first_logits(served, MIX)
    for name in (None, "a", "b"):
        loaded = moe_jax.load_model(BUNDLED, dtype="bfloat16", adapter=adapters[name] if name else None)
        expected = first_logits(loaded, [None] * len(PROMPTS))
        rows = [i for i, n in enumerate(MIX) if n == name]
        if name is None:  # no adapter: the base model's rows exactly
            np.testing.assert_array_equal(mixed[rows], expected[rows])
            base = expected
            continue
        effect = np.abs(expected[rows] - base[rows]).max()
        assert np.abs(mixed[rows] - expected[rows]).max() < 0.05 * effect


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from tests.hf_models import make_hf_model, save_hf_model

    root = tmp_path_factory.mktemp("deepseek_v3")
    model_dir = save_hf_model(make_hf_model("deepseek_v3", seed=5), root / "model")
    return model_dir, {
        # kv_b_proj: the absorbed decode takes its adapter without forming the weight (mla.AbsorbedAdapters)
        "a": random_adapter(model_dir, root / "a", 1, ("kv_b_proj", "o_proj"), 4),
        "b": random_adapter(model_dir, root / "b", 2, ("attention", "up_proj"), 2),
    }


def test_latent_attention_and_mlp_adapters_per_request(deepseek):
    model_dir, adapters = deepseek
    served = moe_jax.load_model(model_dir, adapters=adapters)
    assert served.plan.mla_decode == "absorbed"
    mixed_equals_alone(served, alone(model_dir, adapters))


def test_the_anchor_cache_keeps_each_adapters_kv_apart(adapters):
    anchor = 7
    prompt = [5, 9, 11, 13, 8, 6, anchor, 4, 3]
    served = moe_jax.load_model(BUNDLED, adapters=adapters)
    engine = served.engine(1, 64, AnchorCache([anchor], budget_bytes=1 << 20))

    def run(adapter: str | None):
        request = Request(prompt, 8, adapter=served.adapter_index(adapter))
        return engine.run([request], eos_ids=served.config.eos_token_ids)[0]

    with_a = run("a")
    base = run(None)  # the same prompt's prefix, stored under adapter a: not the base model's KV
    assert base.reused_tokens == 0
    assert base.tokens == served.generate([prompt], max_new_tokens=8)[0]
    again = run("a")
    assert again.reused_tokens > 0 and again.tokens == with_a.tokens


def test_adapters_that_cannot_be_served_are_refused_by_name(adapters, tmp_path):
    model = moe_jax.load_model(BUNDLED)
    experts = random_adapter(BUNDLED, tmp_path / "experts", 3, ("experts",), 2)
    with pytest.raises(InputError, match="'e' .*trains the routed experts"):
        model.serve_adapters({"e": experts})
    with pytest.raises(InputError, match="adapter name 'a:b'"):
        model.serve_adapters({"a:b": adapters["a"]})
    with pytest.raises(CheckpointError, match="no such adapter directory"):
        model.serve_adapters({"x": tmp_path / "missing"})
    other = random_adapter(BUNDLED, tmp_path / "other", 4, ("q_proj",), 2)
    shutil.copy(adapters["b"] / "adapter_model.safetensors", other / "adapter_model.safetensors")  # not its tensors
    with pytest.raises(CheckpointError, match="adapter does not fit"):
        model.serve_adapters({"x": other})
    model.serve_adapters(adapters)
    with pytest.raises(InputError, match="no adapter named 'c' is served; served: a, b"):
        model.generate(PROMPTS, max_new_tokens=2, adapter="c")
    with pytest.raises(InputError, match="2 adapters for 5 prompts"):
        model.generate(PROMPTS, max_new_tokens=2, adapter=["a", "b"])
    model.serve_adapters({})  # none served: a request for one names what there is
    with pytest.raises(InputError, match="served: none"):
        model.generate(PROMPTS, max_new_tokens=2, adapter="a")
