"""Speculative decoding with prompt-lookup drafts: the drafter, the cost policy, and greedy outputs identical to
plain decoding, token for token, in every family and dtype (drafts accepted, rejected, EOS inside a draft, rows
finishing mid-draft, batches of mixed lengths)."""

import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.errors import InputError
from moe_jax.generation.drafting import MAX_NGRAM, prompt_lookup
from moe_jax.generation.engine import GenerationEngine, Request
from moe_jax.generation.speculation import (
    EXPLORE_EVERY,
    EXPLORING_CALLS,
    JUDGED_AFTER,
    MIN_YIELD,
    WINDOW,
    DraftPolicy,
)
from tests.hf_models import make_hf_model, save_hf_model


def lookup(tokens, count, max_ngram=MAX_NGRAM):
    """prompt_lookup of one sequence, as a list."""
    history = np.zeros((1, 64), np.int32)
    history[0, : len(tokens)] = tokens
    drafts, real = prompt_lookup(jnp.asarray(history), jnp.asarray([len(tokens)], jnp.int32), count, max_ngram)
    return np.asarray(drafts)[0, : int(real[0])].tolist()


def reference_lookup(tokens, count, max_ngram=MAX_NGRAM):
    """The tokens after the latest earlier occurrence of the longest suffix of at most max_ngram tokens."""
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[-n:]]
        if ends:
            return tokens[ends[-1] : ends[-1] + count]
    return []


def test_the_lookup_continues_the_latest_occurrence_of_the_longest_suffix():
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" occurred twice before; the latest one went on with 9, 2
    assert lookup(tokens, 2) == [9, 2]
    # now "6 7 8" ends the sequence: only its first occurrence matches that long
    assert lookup([*tokens, 8], 3) == [1, 6, 7]
    assert lookup([1, 2, 3], 4) == []  # nothing repeats: no draft
    assert lookup([4, 4, 4], 3) == [4]  # the suffix's own ending is not a match: one token follows
    assert lookup([7], 3) == []
    rng = np.random.default_rng(0)
    for _ in range(200):  # small alphabets repeat often: every length of match, at every place
        tokens = rng.integers(0, 4, size=rng.integers(1, 40)).tolist()
        count = int(rng.integers(1, 8))
        assert lookup(tokens, count) == reference_lookup(tokens, count), tokens


def test_the_lookup_runs_on_each_row_of_a_batch():
    history = np.zeros((3, 16), np.int32)
    history[0, :5] = [1, 2, 3, 1, 2]
    history[1, :3] = [9, 9, 9]  # the rest of a row past its length is stale: never searched
    history[1, 3:8] = 9
    history[2, :1] = [4]
    drafts, real = prompt_lookup(jnp.asarray(history), jnp.asarray([5, 3, 1], jnp.int32), 4)
    assert np.asarray(real).tolist() == [3, 1, 0]
    assert np.asarray(drafts)[0, :3].tolist() == [3, 1, 2] and np.asarray(drafts)[1, 0] == 9


def calls(policy, rows, width, tokens, seconds, times=JUDGED_AFTER + 1, step_yield=2.0):
    """`times` calls of a width (the first of each kind is left out: it compiles), a speculative one's sequences
    making `step_yield` tokens a step."""
    for _ in range(times):
        policy.observed(rows, width, tokens, seconds)
        if width > 1:
            policy.yielded(rows, width, round(step_yield * 10), 10)


def test_the_policy_tries_wider_steps_while_they_pay_and_keeps_the_fastest():
    policy = DraftPolicy(max_drafts=7)
    assert policy.widths == (1, 2, 4, 8)
    assert policy.choose(rows=1) == 1  # no plain call timed yet
    calls(policy, 1, 1, tokens=32, seconds=0.010)  # 3,200 tokens a second
    assert policy.choose(rows=1) == 2  # the next width is tried
    assert policy.choose(rows=2) == 1  # another row count is another step, not timed yet
    calls(policy, 1, 2, tokens=40, seconds=0.010)
    assert policy.choose(rows=1) == 4  # 2 wide beat plain decoding: 4 wide may too
    calls(policy, 1, 4, tokens=30, seconds=0.010)
    assert policy.choose(rows=1) == 2  # it did not: 8 is not tried, 2 is the fastest
    calls(policy, 1, 2, tokens=20, seconds=0.010, times=12)  # the workload stopped copying
    assert policy.choose(rows=1) == 1


def test_the_policy_never_chooses_a_width_whose_steps_make_too_few_tokens():
    # timed, 2 wide looks faster (this machine's noise can make it so), but its steps make 1.05 tokens a sequence:
    # a wider step costs more than a plain one, so it cannot pay
    policy = DraftPolicy(max_drafts=3)
    calls(policy, 1, 1, tokens=30, seconds=0.010)
    calls(policy, 1, 2, tokens=36, seconds=0.010, step_yield=1.05)
    assert MIN_YIELD > 1.05
    assert policy.choose(rows=1) == 1
    calls(policy, 1, 2, tokens=36, seconds=0.010, times=WINDOW, step_yield=1.8)  # the workload started copying
    assert policy.choose(rows=1) == 4  # and 2 wide is the best so far: 4 wide is tried


def test_the_policy_explores_the_width_tried_longest_ago():
    policy = DraftPolicy(max_drafts=3)
    calls(policy, 4, 1, tokens=100, seconds=0.010)
    calls(policy, 4, 2, tokens=50, seconds=0.010)  # drafts rejected: plain decoding is faster
    chosen = []
    for _ in range(3 * EXPLORE_EVERY):
        chosen.append(policy.choose(rows=4))
        policy.observed(4, chosen[-1], tokens=100 if chosen[-1] == 1 else 40, seconds=0.010)
    # every EXPLORE_EVERY-th decision, EXPLORING_CALLS in a row of the width tried longest ago: 4 (it never ran),
    # then 2, then 4 again
    explored = [(i, w) for i, w in enumerate(chosen) if w != 1]
    starts = [EXPLORE_EVERY * k - 1 for k in (1, 2, 3)]
    assert explored == [(s + i, w) for s, w in zip(starts, (4, 2, 4), strict=True) for i in range(EXPLORING_CALLS)][:-3]
    assert policy.rates[4, 1] == pytest.approx(100 / 0.010)  # its calls' own rate: those after a switch left out
    always = DraftPolicy(max_drafts=3, policy="always")
    assert always.choose(rows=4) == 4
    with pytest.raises(InputError, match="draft policy"):
        DraftPolicy(3, policy="sometimes")
    with pytest.raises(InputError, match="from 1 to"):
        DraftPolicy(0)


# every family without a recurrent state: grouped-query attention (with sliding windows and sinks: gpt_oss; q/k
# norms and sigmoid routing: minimax_m2), latent attention (deepseek_v2/v3) and its sparse form (deepseek_v32)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "gpt_oss", "deepseek_v2",
            "deepseek_v3", "deepseek_v32")  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        paths[family] = tmp_path_factory.mktemp(family)
        save_hf_model(make_hf_model(family, seed=4), paths[family])
    return paths


def requests(seed: int) -> list[Request]:
    """Prompts of mixed lengths, some repeating a motif (drafts from the start, mostly accepted), some not (drafts
    only once the outputs repeat, often rejected), with mixed new-token counts."""
    rng = np.random.default_rng(seed)
    out = []
    for n, m, repeats in ((5, 30, 3), (12, 9, 1), (3, 24, 3), (8, 17, 2), (6, 2, 1), (7, 21, 1)):
        out.append(Request(rng.integers(8, 96, size=n).tolist() * repeats, max_new_tokens=m))
    return out


def generate(model, reqs, slots, drafts, **kwargs):
    # blocks of 4 plain steps between verify steps: many drafting decisions in short generations
    engine = GenerationEngine(model, slots, 128, block_steps=4, drafts=drafts, draft_policy="always")
    return engine, engine.run(reqs, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_outputs_equal_plain_decoding(checkpoints, family, dtype):
    model = moe_jax.load_model(checkpoints[family], backend="host", dtype=dtype)
    reqs = requests(seed=1)
    _, plain = generate(model, reqs, 2, 0)
    engine, speculative = generate(model, reqs, 2, 3)
    assert [c.tokens for c in speculative] == [c.tokens for c in plain]
    assert [c.finish_reason for c in speculative] == [c.finish_reason for c in plain]
    stats = engine.stats
    # drafts were verified, some accepted and some rejected (random weights repeat themselves in short cycles)
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens
    # an EOS that lands inside an accepted draft ends the sequence there
    eos = plain[0].tokens[len(plain[0].tokens) // 2]
    _, plain_eos = generate(model, reqs, 2, 0, eos_ids=[eos])
    _, speculative_eos = generate(model, reqs, 2, 3, eos_ids=[eos])
    assert [(c.tokens, c.finish_reason) for c in speculative_eos] == [(c.tokens, c.finish_reason) for c in plain_eos]


def test_plain_and_speculative_calls_mixed_as_the_cost_policy_goes_give_greedy_outputs(checkpoints):
    # the cost policy starts with plain calls (pipelined: no EOS to watch), then tries wider ones, switching back
    # and forth between engines (the policy is the model's); a stop decided on the host ends a sequence mid-call
    model = moe_jax.load_model(checkpoints["qwen3_moe"], backend="host")
    reqs = requests(seed=2) * 3
    plain = GenerationEngine(model, 4, 128, block_steps=4).run(reqs)
    stop_at = plain[0].tokens[3]

    def should_stop(i, out):
        return out[-1] == stop_at

    plain_stopped = GenerationEngine(model, 4, 128, block_steps=4).run(reqs, should_stop=should_stop)
    drafted = 0
    for _ in range(3):
        engine = GenerationEngine(model, 4, 128, block_steps=4, drafts=3)
        assert [c.tokens for c in engine.run(reqs)] == [c.tokens for c in plain]
        stopped = engine.run(reqs, should_stop=should_stop)
        assert [(c.tokens, c.finish_reason) for c in stopped] == [(c.tokens, c.finish_reason) for c in plain_stopped]
        drafted += engine.stats.drafted_tokens
    policy = model.generation.draft_policy(3, "cost")
    assert drafted > 0 and (4, 1) in policy.rates  # both kinds of call ran


def test_hybrid_models_refuse_it(tmp_path):
    save_hf_model(make_hf_model("qwen3_next", seed=4), tmp_path)
    model = moe_jax.load_model(tmp_path, backend="host")
    with pytest.raises(InputError, match="recurrent state"):
        GenerationEngine(model, 1, 64, drafts=4)
