"""The C heap is trimmed after each long XLA compile (moe_jax/compile_memory.py), and only then; a training step keeps
its freed buffers, generation does not."""

import jax
import jax.numpy as jnp
import pytest

from moe_jax import compile_memory


def test_a_long_compile_trims_the_heap_and_a_short_one_does_not(monkeypatch):
    trims = []
    monkeypatch.setattr(compile_memory, "trim_heap", lambda: trims.append(1))
    compile_memory.trim_after_compiles()
    compile_memory.trim_after_compiles()  # registered once: one trim a compile, not two

    x = jnp.ones(6)
    jax.jit(lambda x: x * 3.0 - 1.0)(x).block_until_ready()  # ~0.02 s: below MIN_COMPILE_S
    assert trims == []

    monkeypatch.setattr(compile_memory, "MIN_COMPILE_S", 0.0)  # any compile counts as long
    jax.jit(lambda x: jnp.sin(x) * 7.0)(x).block_until_ready()
    assert trims == [1]


def test_a_training_step_keeps_its_buffers_and_generation_does_not(monkeypatch, tmp_path):
    import numpy as np

    import moe_jax
    from moe_jax.model.lora import LoRAConfig
    from moe_jax.train import objective
    from tests.hf_models import make_hf_model, save_hf_model

    kept = []
    monkeypatch.setattr(compile_memory, "keep_freed_buffers", kept.append)
    save_hf_model(make_hf_model("mixtral"), tmp_path)
    model = moe_jax.load_model(tmp_path, backend="host")
    model.generate([[5, 6, 7]], max_new_tokens=3)
    assert kept == []  # loading and generating keep glibc's defaults (a decoding process's RSS stays near its model)
    model.attach_lora(LoRAConfig(rank=2, alpha=4, targets=("q_proj",)))
    value_and_grad, lora_state = objective.lora_value_and_grad(model)
    assert kept == [compile_memory.KEEP_BUFFER_BYTES]
    tokens = np.ones((1, 8), np.int32)
    loss, _ = value_and_grad(lora_state, tokens, tokens)
    assert np.isfinite(float(loss))


def test_glibc_takes_the_settings():
    from host_kernels import native

    if native._libc() is None or not hasattr(native._libc(), "mallopt"):
        pytest.skip("no glibc mallopt here")
    assert native.keep_freed_buffers(compile_memory.KEEP_BUFFER_BYTES)
