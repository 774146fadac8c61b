"""Model.close lets go of the weights at once (JAX's caches would keep the host experts alive past the model)."""

import gc
import weakref

import pytest

import moe_jax
from host_kernels.host_moe import HostMoE
from tests.hf_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    save_hf_model(make_hf_model("mixtral", seed=3), path)
    return path


def host_engines() -> list:
    gc.collect()
    return [weakref.ref(o) for o in gc.get_objects() if type(o) is HostMoE]


@pytest.mark.parametrize("quant", [None, "int8"])
def test_close_frees_the_host_experts(checkpoint, quant):
    before = {id(r()) for r in host_engines()}
    model = moe_jax.load_model(checkpoint, backend="host", dtype="bfloat16" if quant else "float32", quant=quant)
    expected = model.generate([[5, 6, 7]], max_new_tokens=4)
    mine = [r for r in host_engines() if id(r()) not in before]
    assert len(mine) == 1
    model.close()
    assert mine[0]() is None  # gone with the model's compiled steps, not at the end of the process
    with pytest.raises(moe_jax.InputError, match="closed"):
        model.generate([[5, 6, 7]], max_new_tokens=4)
    with pytest.raises(moe_jax.InputError, match="closed"):
        model.logits([[5, 6, 7]])
    model.close()  # twice: nothing more to do
    with moe_jax.load_model(checkpoint, backend="host", dtype="bfloat16" if quant else "float32", quant=quant) as again:
        assert again.generate([[5, 6, 7]], max_new_tokens=4) == expected  # a new load after a close works as before
    with pytest.raises(moe_jax.InputError, match="closed"):
        again.logits([[5, 6, 7]])
