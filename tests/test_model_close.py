"""A model lets go of its weights when dropped, and at once with Model.close (JAX's caches of its compiled steps
reach its host experts: a cycle through the model kept them alive after it was dropped)."""

import gc
import weakref

import pytest

import moe_jax
from host_kernels.host_moe import HostMoE
from tests.hf_models import make_hf_model, save_hf_model

PROMPT = [[5, 6, 7]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    save_hf_model(make_hf_model("mixtral", seed=3), path)
    return path


def host_engines() -> dict:
    gc.collect()
    return {id(o): weakref.ref(o) for o in gc.get_objects() if type(o) is HostMoE}


def loaded(checkpoint, quant):
    """A model that has generated and computed logits, its host engine (weakly), and its tokens."""
    before = host_engines()
    model = moe_jax.load_model(checkpoint, backend="host", dtype="bfloat16" if quant else "float32", quant=quant)
    tokens = model.generate(PROMPT, max_new_tokens=4)
    model.logits(PROMPT)
    mine = [ref for key, ref in host_engines().items() if key not in before]
    assert len(mine) == 1
    return model, mine[0], tokens


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_dropped_model_frees_its_host_experts(checkpoint, quant):
    model, engine, _ = loaded(checkpoint, quant)
    held = model.engine(2, 32)  # an engine the caller still holds keeps the model
    del model
    gc.collect()
    assert engine() is not None
    del held
    gc.collect()
    assert engine() is None


@pytest.mark.parametrize("quant", [None, "int8"])
def test_close_frees_the_host_experts_while_the_model_is_referred_to(checkpoint, quant):
    model, engine, tokens = loaded(checkpoint, quant)
    model.close()
    assert engine() is None
    with pytest.raises(moe_jax.InputError, match="closed"):
        model.generate(PROMPT, max_new_tokens=4)
    with pytest.raises(moe_jax.InputError, match="closed"):
        model.logits(PROMPT)
    model.close()  # twice: nothing more to do
    with moe_jax.load_model(checkpoint, backend="host", dtype="bfloat16" if quant else "float32", quant=quant) as again:
        assert again.generate(PROMPT, max_new_tokens=4) == tokens  # a fresh load after a close generates the same
    with pytest.raises(moe_jax.InputError, match="closed"):
        again.logits(PROMPT)
