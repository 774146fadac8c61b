"""The execution plan (moe_jax/planning/plan.py): decided once at load from the machine and explicit choices, the
environment only a default; the model runs what it says, and every plan computes the same function."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_jax
from host_kernels import HostKernelError, HostMoE, KernelChoice, choose_kernels
from host_kernels.layer_experts import LayerExperts
from host_kernels.store import ExpertStore
from moe_jax import doctor
from moe_jax.native import argmax as native_argmax
from moe_jax.native import cache_attention as native_attention
from moe_jax.native import dense as native_dense
from moe_jax.native import ffi as native_ffi
from moe_jax.planning.plan import make_plan
from tests.hf_models import make_hf_model, save_hf_model

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(make_hf_model("mixtral", seed=5), tmp_path_factory.mktemp("mixtral"))


def test_default_plan_follows_this_machine():
    for dtype, store in (("float32", np.float32), ("bfloat16", BF16)):
        plan = make_plan(dtype, store)
        assert plan.host_kernels == choose_kernels(store)
        assert plan.experts_ffi == (bool(plan.host_kernels.fused) and native_ffi.status()[0])
        assert plan.argmax == native_argmax.status()[0]
        assert plan.cache_attention == native_attention.status()[0]  # over bfloat16 and float32 caches
        assert plan.dense_decode == native_dense.dense_kernel(store)[0]  # bfloat16 or float32 weights
        for part, native in (("attention", plan.cache_attention), ("dense", plan.dense_decode)):
            assert bool(plan.reason(part)) != native  # every part not native says why
    assert make_plan("float32").host_kernels is None  # no host engine: no host kernels


def test_native_off_turns_every_part_off_and_says_so():
    plan = make_plan("bfloat16", BF16, native=False)
    assert plan.host_kernels == KernelChoice("numpy", "", "numpy", plan.host_kernels.why)
    assert not (plan.experts_ffi or plan.cache_attention or plan.dense_decode or plan.argmax)
    for part in ("attention", "dense", "argmax"):
        assert plan.reason(part) == "XLA FFI handlers turned off by the caller"
    assert all("turned off by the caller" in why for why in plan.host_kernels.why.values())
    text = "\n".join(plan.lines())
    assert "greedy argmax and sampling: XLA (XLA FFI handlers turned off by the caller)" in text


def test_environment_is_only_the_default(monkeypatch):
    monkeypatch.setenv("MOE_JAX_XLA_FFI", "0")
    monkeypatch.setenv("MOE_JAX_HOST_KERNEL", "numpy")
    plan = make_plan("float32", np.float32)
    assert not plan.argmax and plan.reason("argmax") == "MOE_JAX_XLA_FFI=0"
    assert plan.host_kernels.gemm == "numpy" and plan.host_kernels.why["activations"] == "MOE_JAX_HOST_KERNEL=numpy"
    monkeypatch.delenv("MOE_JAX_XLA_FFI")
    monkeypatch.delenv("MOE_JAX_HOST_KERNEL")
    default = make_plan("float32", np.float32)
    monkeypatch.setenv("MOE_JAX_XLA_FFI", "0")
    monkeypatch.setenv("MOE_JAX_HOST_KERNEL", "numpy")
    assert make_plan("float32", np.float32, native=True) == default  # an argument beats the environment


def test_every_plan_computes_the_same_logits_and_tokens(checkpoint):
    ids = np.random.default_rng(4).integers(0, 96, size=(2, 10))
    prompts = [[5, 9, 2], [7, 1, 1, 3, 8]]
    native = moe_jax.load_model(checkpoint, backend="host")
    plain = moe_jax.load_model(checkpoint, backend="host", native=False)
    assert plain.plan == make_plan("float32", np.float32, native=False)
    np.testing.assert_allclose(plain.logits(ids), native.logits(ids), rtol=1e-4, atol=1e-4)
    assert plain.generate(prompts, max_new_tokens=5) == native.generate(prompts, max_new_tokens=5)
    decode = plain.generation.steps().decode
    tokens = np.zeros((2, 1), np.int32)
    hlo = decode.lower(plain.state_leaves(), plain.kv.new_caches(2, 16), tokens, tokens > 0, tokens, tokens).as_text()
    assert "moe_jax_" not in hlo  # no custom call of ours: XLA and Python callbacks only


def test_a_choice_that_cannot_read_the_store_is_refused():
    store = ExpertStore({0: LayerExperts(np.ones((2, 32, 64), np.float32), np.ones((2, 32, 32), np.float32))})
    for bad in (KernelChoice("amx-bf16", "", "numpy"), KernelChoice("numpy", "amx-bf16", "numpy")):
        with pytest.raises(HostKernelError, match="cannot run a float32 store"):
            HostMoE(store, threads=1, kernels=bad)


def test_doctor_reports_the_machine_and_both_plans(tmp_path, capsys):
    assert doctor.main(["--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "CPU features: " in out and "avx512f" in out
    assert "a float32 model with backend=host runs:" in out and "a bfloat16 model with backend=host runs:" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"float32", "bfloat16"} <= set(report["plans"])
    quantized = {"bfloat16, quant=int8", "bfloat16, quant=int4"}
    assert set(report["plans"]) | set(report["unavailable"]) == {"float32", "bfloat16"} | quantized
    assert report["plans"]["float32"]["lines"] == make_plan("float32", np.float32).lines()
    assert doctor.main(["--no-native"]) == 0
    assert "greedy argmax and sampling: XLA" in capsys.readouterr().out


def test_the_environment_is_read_in_one_module():
    """Only moe_jax/planning/environment.py reads environment variables; the launcher and the server's test
    process copy the whole environment for the processes they start, reading nothing from it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    copies = {"moe_jax/launch.py", "moe_jax/serving/process.py"}
    for path in sorted((root / "moe_jax").rglob("*.py")) + sorted((root / "host_kernels").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name == "moe_jax/planning/environment.py":
            continue
        tree = ast.parse(path.read_text())
        unpacked = [d for d in ast.walk(tree) if isinstance(d, ast.Dict)]  # {**os.environ, ...}: a copy
        starred = {id(v) for d in unpacked for k, v in zip(d.keys, d.values, strict=True) if k is None}
        for node in ast.walk(tree):
            reads = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            reads = reads and isinstance(node.value, ast.Name) and node.value.id == "os"
            if reads:
                copy = name in copies and id(node) in starred
                assert copy, f"{name}:{node.lineno} reads the environment (read it in moe_jax/planning/environment.py)"


def test_the_plan_names_the_routers_kernels_and_one_row_padding():
    """The plan decides the routers' decode kernels (never quantized) and the one-row bfloat16 padding; the model
    modules take them from it instead of asking the machine."""
    plan = make_plan("bfloat16", None, quant="int8")
    assert plan.pad_one_row == (jax.default_backend() == "cpu")
    if plan.dense_decode:
        assert plan.router_kernel(np.float32) == native_dense.dense_kernel(np.float32)[0]
        assert plan.router_kernel(jnp.bfloat16) == native_dense.dense_kernel(jnp.bfloat16)[0]
        assert "int8" not in plan.router_kernel(jnp.bfloat16)
    off = make_plan("bfloat16", None, native=False)
    assert off.router_decode == () and off.router_kernel(jnp.bfloat16) == ""
    assert not make_plan("float32", None).pad_one_row
