"""The native argmax a greedy decode step ends with (host_kernels/csrc/xla_argmax.c): numpy's answer on every row."""

import functools

import jax
import numpy as np
import pytest

from moe_jax.native import argmax as native_argmax
from tests.isa import variants

pytestmark = pytest.mark.skipif(not native_argmax.status()[0], reason=native_argmax.status()[1])


def native(logits, isa=None):
    f = jax.jit(functools.partial(native_argmax.argmax_tokens, native=True, isa=isa))
    assert native_argmax.TARGET in f.lower(logits).as_text()
    return np.asarray(f(logits))[:, 0]


@pytest.mark.parametrize("isa", variants(native_argmax.status))
@pytest.mark.parametrize("vocab", [1, 7, 8, 15, 16, 37, 4096])
def test_first_maximum_of_each_row(vocab, isa):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((9, vocab)).astype(np.float32)
    logits[1] = 0.0  # all tied: the first
    logits[2, -1] = np.inf
    logits[3] = -np.inf
    logits[4] = np.round(logits[4])  # ties across lanes and blocks
    logits[5, vocab // 2] = np.nan
    logits[6, : vocab // 3] = np.nan
    logits[7] = -0.0
    logits[7, -1] = 0.0  # equal to -0.0: the first still wins
    logits[8, -1] = np.nan  # a NaN only in the last values (AVX2: past the whole blocks)
    np.testing.assert_array_equal(native(logits, isa), np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(native(logits, isa), np.asarray(jax.numpy.argmax(logits, axis=-1)))


def test_turned_off_it_is_jax_argmax():
    logits = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)
    f = jax.jit(functools.partial(native_argmax.argmax_tokens, native=False))
    assert native_argmax.TARGET not in f.lower(logits).as_text()
    np.testing.assert_array_equal(np.asarray(f(logits))[:, 0], np.argmax(logits, axis=-1))
