"""Tokens sampled where the logits are (moe_jax/native/sample.py): the native handler on each instruction set and the
jax.numpy version give the host sampler's token for the same draw, and the engine's sampled decode blocks give the
tokens of one step a call chosen on the host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.generation.batch import Job, Request, Sampling
from moe_jax.generation.engine import GenerationEngine
from moe_jax.generation.sampling import sample
from moe_jax.native import sample as native_sample
from moe_jax.native.sample import TokenChoice, host_draws, sample_tokens
from tests.hf_models import make_hf_model, save_hf_model

SETTINGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.95, 40), (0.5, 1.0, 3), (2.0, 0.5, 0), (1.0, 0.9, 1), (0.0, 1.0, 0)]


class Draws:
    """A generator whose draws are given: the host sampler's `rng` for one draw each."""

    def __init__(self, draws):
        self.draws = list(draws)

    def random(self):
        return self.draws.pop(0)


def samplers():
    """(name, isa or None for jax.numpy) of every way this machine can sample on the device."""
    out = [("jax.numpy", None)]
    for isa in native_sample.CPU_FLAGS:
        usable, why = native_sample.status(isa)
        out.append(pytest.param(isa, isa, marks=pytest.mark.skipif(not usable, reason=f"native {isa}: {why}")))
    return out


def device_tokens(logits, choice, isa):
    step = jax.jit(lambda x, c: sample_tokens(x, c, isa is not None, isa))
    return np.asarray(step(jnp.asarray(logits), choice))[:, 0]


def choice_of(rows, temperature, top_p, top_k, draws):
    return TokenChoice(
        jnp.full(rows, temperature, jnp.float32),
        jnp.full(rows, top_p, jnp.float32),
        jnp.full(rows, top_k, jnp.int32),
        jnp.asarray(host_draws(draws)),
    )


@pytest.mark.parametrize("name, isa", samplers())
@pytest.mark.parametrize("vocab", [7, 300, 32000])
def test_device_tokens_are_the_host_samplers_for_the_same_draws(name, isa, vocab):
    logits_rng = np.random.default_rng(vocab)
    for scale in (0.3, 3.0, 12.0):  # flat (a nucleus of most of the vocabulary) to peaked
        logits = (logits_rng.standard_normal((24, vocab)) * scale).astype(np.float32)
        logits[0, : vocab // 2] = logits[0, 0]  # ties, also at the k-th value and inside the nucleus
        logits[1, 1::2] = -np.inf  # masked tokens never come
        for temperature, top_p, top_k in SETTINGS:
            draws = logits_rng.random(len(logits))
            host = [
                sample(row[None], Draws([u]), temperature, top_p, top_k)[0]
                for row, u in zip(logits, draws, strict=True)
            ]
            got = device_tokens(logits, choice_of(len(logits), temperature, top_p, top_k, draws), isa)
            assert got.tolist() == host, (scale, temperature, top_p, top_k)
            assert got[1] % 2 == 0


@pytest.mark.parametrize("name, isa", samplers())
def test_rows_sample_with_their_own_settings_and_greedy_rows_take_their_argmax(name, isa):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((len(SETTINGS), 500)) * 2).astype(np.float32)
    draws = rng.random(len(SETTINGS))
    t, p, k = (np.array(column) for column in zip(*SETTINGS, strict=True))
    choice = TokenChoice(*(jnp.asarray(a) for a in (t.astype(np.float32), p.astype(np.float32), k.astype(np.int32))),
                         jnp.asarray(host_draws(draws)))  # fmt: skip
    expected = [sample(row[None], Draws([u]), *s)[0] for row, u, s in zip(logits, draws, SETTINGS, strict=True)]
    assert device_tokens(logits, choice, isa).tolist() == expected
    assert expected[-1] == logits[-1].argmax()  # (the temperature-0 row)


def test_draws_keep_their_float64_bits():
    draws = np.random.default_rng(0).random(1000)
    bits = host_draws(draws)
    assert bits.shape == (1000, 2) and bits.dtype == np.uint32
    assert np.array_equal(bits.view(np.float64)[:, 0], draws)
    # jax.numpy's float32 reading of them: within float32 rounding, and never 1
    as_f32 = np.asarray(jax.jit(native_sample._draws_f32)(jnp.asarray(bits)))
    assert np.allclose(as_f32, draws, rtol=2**-23, atol=0) and as_f32.max() < 1


@pytest.mark.parametrize("isa", [i for i in native_sample.CPU_FLAGS])
def test_a_broken_row_is_refused_natively(isa):
    usable, why = native_sample.status(isa)
    if not usable:
        pytest.skip(f"native {isa}: {why}")
    logits = np.zeros((2, 50), np.float32)
    logits[1, 7] = np.nan
    with pytest.raises(Exception, match="NaN or inf"):
        device_tokens(logits, choice_of(2, 1.0, 1.0, 0, [0.5, 0.5]), isa)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    save_hf_model(make_hf_model("qwen3_moe", seed=4), path)
    return moe_jax.load_model(path, backend="host", dtype="float32")


def generate(model, requests, sampling, block_steps, on_logprobs=None):
    """Each request's tokens from a batch of them (Batch jobs, as the server runs them)."""
    engine = GenerationEngine(model, len(requests), 96, block_steps=block_steps)
    results = {}
    jobs = [
        Job(r, s, on_finish=lambda done, i=i: results.__setitem__(i, done.tokens), on_logprobs=on_logprobs)
        for i, (r, s) in enumerate(zip(requests, sampling, strict=True))
    ]
    with engine.batch(len(jobs)) as batch:
        batch.admit(jobs)
        while batch.active:
            batch.step()
    return [results[i] for i in range(len(jobs))], engine.stats


def test_sampled_blocks_make_the_tokens_of_host_sampling(model):
    rng = np.random.default_rng(8)
    requests = [Request(rng.integers(8, 96, size=n).tolist(), 20, seed=i) for i, n in enumerate((5, 2, 9))]
    on_device = [Sampling(0.9, 0.95, 20), Sampling(0.0), Sampling(1.2)]  # a greedy row among sampled ones
    # asking for log-probabilities has the host choose every token from the step's logits, one step a call
    on_host = [Sampling(s.temperature, s.top_p, s.top_k, logprobs=0) for s in on_device]
    blocks, block_stats = generate(model, requests, on_device, block_steps=8)
    host, host_stats = generate(model, requests, on_host, block_steps=8, on_logprobs=lambda _: None)
    assert blocks == host
    assert len(set(map(tuple, blocks))) == 3 and len(set(blocks[0])) > 3  # (sampling, not a fixed point)
    assert host_stats.decode_calls == 19 and block_stats.decode_calls == 3  # 19 steps in blocks of up to 8
