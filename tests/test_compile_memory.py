"""The C heap is trimmed after each long XLA compile (moe_jax/compile_memory.py), and only then."""

import jax
import jax.numpy as jnp

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
