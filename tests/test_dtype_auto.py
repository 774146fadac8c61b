"""dtype="auto", the default everywhere: a checkpoint loads in its own precision (bfloat16 for a bfloat16 one, as
transformers' dtype="auto" does), an explicit dtype overrides it, and the CLIs and the training config take it."""

from __future__ import annotations

import numpy as np
import pytest

import moe_jax
from moe_jax.convert import convert
from moe_jax.errors import ConfigError, InputError
from moe_jax.train.config import TrainConfig
from tests.gguf_files import write_gguf
from tests.hf_models import make_hf_model, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

IDS = np.random.default_rng(3).integers(0, 96, size=(2, 9))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny Mixtral saved in float32, bfloat16 and float16."""
    root = tmp_path_factory.mktemp("dtypes")
    hf = make_hf_model("mixtral", intermediate_size=64)
    paths = {"float32": save_hf_model(hf, root / "f32")}
    for name, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        paths[name] = save_hf_model(make_hf_model("mixtral", intermediate_size=64).to(torch_dtype), root / name)
    paths["gguf_q4_0"] = write_gguf(hf, root / "q4_0.gguf", dense="F32", experts="Q4_0")
    paths["gguf_f32"] = write_gguf(hf, root / "f32.gguf")
    paths["converted_q4_0"] = convert(paths["gguf_q4_0"], root / "converted", progress=False)
    paths["converted_f32"] = convert(paths["float32"], root / "converted_f32", progress=False)
    return paths


@pytest.mark.parametrize(
    "checkpoint, expected",
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float32"),  # float16 is exact in float32, rounded in bfloat16
        ("gguf_q4_0", "bfloat16"),
        ("gguf_f32", "float32"),
        ("converted_q4_0", "bfloat16"),  # its store's: what convert chose from the GGUF file
        ("converted_f32", "float32"),
    ],
)
def test_the_default_keeps_the_checkpoints_own_precision(checkpoints, checkpoint, expected):
    model = moe_jax.load_model(checkpoints[checkpoint], backend="host")
    assert model.dtype == expected
    assert str(model.transformer.embed[...].dtype) == expected


def test_auto_loads_what_naming_the_dtype_loads_and_an_explicit_dtype_overrides(checkpoints):
    bf16 = checkpoints["bfloat16"]
    auto = moe_jax.load_model(bf16, backend="host")
    named = moe_jax.load_model(bf16, backend="host", dtype="bfloat16")
    np.testing.assert_array_equal(auto.logits(IDS), named.logits(IDS))
    assert moe_jax.load_model(bf16, backend="host", dtype="float32").dtype == "float32"
    with pytest.raises(InputError, match="choose one of auto, float32, bfloat16"):
        moe_jax.load_model(bf16, dtype="float16")


def test_training_config_and_clis_default_to_auto():
    import infer
    from moe_jax import serve

    assert TrainConfig().dtype == "auto"
    assert infer.parse_args(["--model", "m"]).dtype == "auto"
    assert serve.parse_args(["--model", "m"]).dtype == "auto"
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16"):
        TrainConfig(dtype="half").validate()
