"""The generation engine: continuous batching and the semantic anchor cache keep outputs exact."""

import numpy as np
import pytest

import moe_jax
from moe_jax.generation.anchor_cache import AnchorCache
from moe_jax.generation.engine import GenerationEngine, Request
from tests.hf_models import make_hf_model, save_hf_model

ANCHOR = 7  # token id that ends a "message" in these synthetic conversations


# bfloat16 too: its cache rounds every entry, and cached, batched and alone runs split the same tokens into
# different prefill and decode steps
@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("mixtral")
    save_hf_model(make_hf_model("mixtral", seed=21), path)
    return moe_jax.load_model(path, backend="host", dtype=request.param)


def run(model, requests, slots=4, cache=None, max_len=96):
    engine = GenerationEngine(model, slots, max_len, cache)
    return engine, engine.run(requests)


def test_more_prompts_than_slots_refill_at_once(model):
    rng = np.random.default_rng(0)
    lengths = [3, 12, 2, 9, 5, 1, 7]
    requests = [
        Request(rng.integers(8, 96, size=n).tolist(), max_new_tokens=m)
        for n, m in zip(lengths, [2, 9, 3, 8, 2, 6, 4], strict=True)
    ]
    alone = [run(model, [r], slots=1)[1][0].tokens for r in requests]
    engine, together = run(model, requests, slots=2)
    assert [c.tokens for c in together] == alone
    assert all(c.finish_reason == "length" for c in together)
    # continuous batching: a slot refills as soon as its sequence ends, so the steps are close to
    # total tokens / slots rather than the sum of each static batch's longest sequence
    static_steps = sum(max(r.max_new_tokens for r in requests[i : i + 2]) - 1 for i in range(0, len(requests), 2))
    assert engine.stats.decode_steps < static_steps


def test_sequences_ending_early_free_their_slots_exactly(model):
    # greedy steps run one ahead of the host: a slot whose EOS (or stop string) the host reads has already been
    # decoded once more; that token must be dropped and the slot handed to the next prompt intact
    rng = np.random.default_rng(5)
    requests = [Request(rng.integers(8, 96, size=n).tolist(), max_new_tokens=8) for n in (4, 9, 3, 6, 5)]
    full = [c.tokens for c in run(model, requests, slots=1)[1]]
    eos = full[0][2]  # the first request ends on its third token
    expected = [t[: t.index(eos) + 1] if eos in t else t for t in full]
    for slots in (1, 2):
        completions = GenerationEngine(model, slots, 96).run(requests, eos_ids=[eos])
        assert [c.tokens for c in completions] == expected
        assert [c.finish_reason for c in completions] == ["eos" if eos in t else "length" for t in full]
    stop_after = {1: 3, 3: 1}  # request index -> tokens after which a stop string "matched"
    completions = GenerationEngine(model, 2, 96).run(requests, should_stop=lambda i, out: len(out) == stop_after.get(i))
    assert [c.tokens for c in completions] == [t[: stop_after.get(i, 8)] for i, t in enumerate(full)]
    assert [c.finish_reason for c in completions] == ["length", "stop", "length", "stop", "length"]


@pytest.mark.parametrize("slots", [1, 3])
def test_blocks_of_greedy_steps_give_the_tokens_of_single_steps(model, slots):
    # several steps a call while every job has that many tokens to go: the same tokens, sequences that end inside
    # a block (EOS, a stop string) drop the block's rest, and a waiting prompt takes the freed slot after it
    rng = np.random.default_rng(11)
    shapes = [(4, 17), (9, 12), (3, 6), (6, 20), (2, 11)]  # (prompt tokens, new tokens)
    requests = [Request(rng.integers(8, 96, size=n).tolist(), max_new_tokens=m) for n, m in shapes]
    single = GenerationEngine(model, slots, 96, block_steps=1)
    full = [c.tokens for c in single.run(requests)]
    assert single.stats.decode_calls == single.stats.decode_steps
    eos = full[3][9]  # a token request 3 makes late (a block or more in)
    stop_after = {0: 6, 4: 4}

    def runs(block_steps):
        engine = GenerationEngine(model, slots, 96, block_steps=block_steps)
        outputs = [engine.run(requests)]
        outputs.append(engine.run(requests, eos_ids=[eos]))
        outputs.append(engine.run(requests, should_stop=lambda i, out: len(out) == stop_after.get(i)))
        return engine, [[(c.tokens, c.finish_reason) for c in completions] for completions in outputs]

    one, expected = runs(1)
    assert expected[0] == [(t, "length") for t in full]
    assert any(reason == "eos" for _, reason in expected[1]) and expected[1] != expected[0]
    for block_steps in (4, 8):
        engine, got = runs(block_steps)
        assert got == expected
        assert engine.stats.decode_tokens == one.stats.decode_tokens
        assert engine.stats.decode_calls < one.stats.decode_calls  # blocks ran


def test_a_block_ends_on_the_step_that_made_an_eos(model):
    # a block stops on the device after a watched row's EOS: no step is spent past that sequence's end, and the
    # rows that go on continue at the positions the block reached (their tokens as one step a call makes them)
    rng = np.random.default_rng(12)
    requests = [Request(rng.integers(8, 96, size=n).tolist(), max_new_tokens=24) for n in (5, 8, 3)]
    full = [c.tokens for c in GenerationEngine(model, 1, 96, block_steps=1).run(requests)]
    # request 0 ends on a token it makes first well inside the first block (the prefill makes its token 0)
    ends = next(i for i in range(4, 20) if full[0][i] not in full[0][:i])
    eos = full[0][ends]
    engine = GenerationEngine(model, 1, 96, block_steps=32)
    (alone,) = engine.run(requests[:1], eos_ids=[eos])
    assert (alone.tokens, alone.finish_reason) == (full[0][: ends + 1], "eos")
    assert engine.stats.decode_steps == ends and engine.stats.decode_calls == 1
    # three sequences in three slots: the block ends where request 0 (or another) makes the EOS, the others go on
    expected = [t[: t.index(eos) + 1] if eos in t else t for t in full]
    engine = GenerationEngine(model, 3, 96, block_steps=32)
    together = engine.run(requests, eos_ids=[eos])
    assert [c.tokens for c in together] == expected
    assert engine.stats.decode_calls >= 2  # the first block ended early and the next one went on from there
    assert engine.stats.decode_steps == max(len(t) for t in expected) - 1


def test_greedy_steps_stop_with_the_last_token(model):
    # the host knows when a sequence's length runs out: no step is dispatched whose output would all be dropped
    engine, (completion,) = run(model, [Request([9, 4, 30], max_new_tokens=5)], slots=1)
    assert len(completion.tokens) == 5 and engine.stats.decode_steps == 4 and engine.stats.decode_tokens == 4
    assert engine.stats.decode_calls == 1  # the 4 tokens after the prefill's: one block as long as what is left


def test_sampled_tokens_do_not_depend_on_the_batch(model):
    rng = np.random.default_rng(6)
    requests = [Request(rng.integers(8, 96, size=n).tolist(), 6, seed=i) for i, n in enumerate((5, 2, 8))]
    kwargs = dict(temperature=0.9, top_p=0.95, top_k=20)
    alone = [GenerationEngine(model, 1, 96).run([r], **kwargs)[0].tokens for r in requests]
    assert [c.tokens for c in GenerationEngine(model, 2, 96).run(requests, **kwargs)] == alone


def conversation(rng, turns):
    """Token ids of a chat-like prompt: turns of random tokens, each ended by the anchor token."""
    tokens = []
    for n in turns:
        tokens += rng.integers(8, 96, size=n).tolist() + [ANCHOR]
    return tokens


def test_anchor_cache_reuses_prefixes_exactly(model):
    rng = np.random.default_rng(1)
    first = conversation(rng, [6, 5, 4])
    second = first + rng.integers(8, 96, size=5).tolist()  # the harness appended a turn
    edited = first[:7] + rng.integers(8, 96, size=6).tolist() + [ANCHOR] + second[-5:]  # second turn rewritten
    cache = AnchorCache([ANCHOR], budget_bytes=1 << 20)
    prompts = [first + [3], second, edited]
    with_cache = [run(model, [Request(p, 6)], slots=1, cache=cache)[1][0] for p in prompts]
    without = [run(model, [Request(p, 6)], slots=1)[1][0] for p in prompts]
    assert [c.tokens for c in with_cache] == [c.tokens for c in without]
    assert [c.reused_tokens for c in with_cache] == [0, len(first), 7]  # the edit forces re-prefill after it
    summary = cache.summary()
    assert summary["prompt_tokens"] == sum(map(len, prompts))
    assert summary["prefilled_tokens"] == summary["prompt_tokens"] - len(first) - 7
    assert summary["hits"] == 2 and summary["bytes_held"] > 0


def test_anchor_cache_evicts_lru_under_budget_with_descendants():
    layers, kv, hd = 2, 2, 4

    def kv_of_range(start, end):
        return [(np.ones((end - start, kv, hd), np.float32), np.ones((end - start, kv, hd), np.float32))] * layers

    per_token = layers * 2 * kv * hd * 4
    cache = AnchorCache([ANCHOR], budget_bytes=10 * per_token)
    a = [1, 2, ANCHOR, 3, ANCHOR, 9]  # segments of 3 and 2 tokens
    cache.store(a, kv_of_range)
    assert cache.bytes_held == 5 * per_token
    b = [4, 5, 6, 8, ANCHOR, 9]  # 5 tokens: fits exactly
    cache.store(b, kv_of_range)
    assert cache.bytes_held == 10 * per_token
    c = [8, 8, ANCHOR, 9]  # 3 more tokens: the least recently used root (a's) goes, with its child
    cache.store(c, kv_of_range)
    assert cache.bytes_held == 8 * per_token and cache.stats.evictions == 2
    assert cache.lookup(a)[0] == 0 and cache.lookup(b)[0] == 5 and cache.lookup(c)[0] == 3


def test_generate_through_the_engine_matches_alone_in_batch(model):
    prompts = [[9, 10, 11], [12] * 20, [30, 31]]
    alone = [model.generate([p], max_new_tokens=5)[0] for p in prompts]
    assert model.generate(prompts, max_new_tokens=5) == alone


def test_chunked_prefill_of_long_prompts(model, monkeypatch):
    import moe_jax.generation.engine as engine_module

    rng = np.random.default_rng(3)
    requests = [Request(rng.integers(8, 96, size=n).tolist(), 4) for n in (70, 5, 33)]
    whole = [c.tokens for c in run(model, requests, slots=3, max_len=128)[1]]
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 32)  # 70 tokens: three chunks
    assert [c.tokens for c in run(model, requests, slots=3, max_len=128)[1]] == whole


def test_request_that_does_not_fit_the_cache_is_refused(model):
    engine = GenerationEngine(model, 2, 32)
    with pytest.raises(moe_jax.InputError, match="request 1: 30 prompt tokens \\+ 8 new tokens do not fit"):
        engine.run([Request([5, 6], 4), Request([9] * 30, 8)])


def test_generation_pauses_the_cycle_collector_and_restores_it(model):
    import gc

    from moe_jax.generation.engine import gc_paused

    seen = []
    engine = GenerationEngine(model, 1, 32)
    engine.run([Request([5, 9, 2], 3)], on_finish=lambda i, c: seen.append(gc.isenabled()))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own choice stays
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_cache_writes_are_exact(dtype):
    # write_positions moves a prefill's entries into the cache with a one-hot product: bit-exact, every dtype
    import jax.numpy as jnp

    from moe_jax.model.layers import write_positions

    rng = np.random.default_rng(4)
    cache = jnp.asarray(rng.standard_normal((2, 3, 20, 8)), dtype)
    new = jnp.asarray(rng.standard_normal((2, 3, 5, 8)) * 1e3, dtype)
    positions = np.array([[3, 4, 5, 6, 7], [15, 16, 17, 18, 19]], np.int32)
    got = np.asarray(write_positions(cache, new, positions, np.broadcast_to(np.arange(20), (2, 20))))
    want = np.asarray(cache).copy()
    for row in range(2):
        want[row][:, positions[row]] = np.asarray(new[row])
    np.testing.assert_array_equal(got, want)
