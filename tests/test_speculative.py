"""Speculative decoding with prompt-lookup drafts: the drafter, the cost policy, and greedy outputs identical to
plain decoding, token for token, in every family and dtype (drafts accepted, rejected, EOS inside a draft, rows
finishing mid-draft, batches of mixed lengths)."""

import numpy as np
import pytest

import moe_jax
from moe_jax.errors import InputError
from moe_jax.generation.drafting import NgramDrafter
from moe_jax.generation.engine import GenerationEngine, Request
from moe_jax.generation.speculation import Acceptance, DraftPolicy
from tests.hf_models import make_hf_model, save_hf_model


def test_the_drafter_continues_the_latest_occurrence_of_the_longest_suffix():
    drafter = NgramDrafter([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # "6 7" occurred twice before; the latest one went on with 9, 2
    assert drafter.propose(2) == [9, 2]
    drafter.extend([8])  # now "6 7 8" ends the sequence: only its first occurrence matches that long
    assert drafter.propose(3) == [1, 6, 7]
    assert NgramDrafter([1, 2, 3]).propose(4) == []  # nothing repeats: no draft
    assert NgramDrafter([4, 4, 4]).propose(3) == [4]  # the suffix's own ending is not a match: one token follows
    assert drafter.propose(0) == []


def timed(policy, rows, width, seconds):
    """Feeds the policy a call's time twice: the first of each kind is left out (it compiles)."""
    for _ in range(2):
        if width == 1:
            policy.plain_call(rows, 1, seconds)
        else:
            policy.measured(rows, width, seconds)


def test_the_policy_drafts_only_where_it_pays():
    policy = DraftPolicy(max_drafts=7)
    hopeful, hopeless = Acceptance(9, 10), Acceptance(0, 50)
    assert policy.choose([(hopeful, 7)], 1, rows=1) == 1  # no plain call timed yet
    policy.plain_call(1, 1, 10.0)  # a first call compiles: left out
    assert policy.choose([(hopeful, 7)], 1, rows=1) == 1
    policy.plain_call(1, 1, 0.010)
    assert policy.choose([(hopeful, 7)], 1, rows=1) == 8  # unmeasured widths are guessed at a one-step call's cost
    assert policy.choose([(hopeful, 7)], 1, rows=2) == 1  # another row count is another step, not timed yet
    assert policy.choose([(hopeful, 0)], 1, rows=1) == 1  # no drafts: nothing to verify
    for width, seconds in ((2, 0.011), (4, 0.013), (8, 0.030)):
        timed(policy, 1, width, seconds)
    assert policy.choose([(hopeful, 7)], 1, rows=1) == 4  # 8 wide costs 3x a plain step: 4 wide yields more
    assert policy.choose([(hopeless, 7)], 1, rows=1) == 1
    assert not policy.worth_a_look([hopeless], 1, rows=1)  # the batch need not wait for its step in flight


def test_the_policy_weighs_drafts_against_plain_decoding_at_its_best():
    # plain steps at 1.125 ms in a 32-step block (a call's fixed cost shared), slower in short calls around verify
    # steps; a verify step pays its own
    policy = DraftPolicy(max_drafts=3)
    for steps, seconds in ((32, 0.036), (32, 0.036), (1, 0.004), (2, 0.006)):
        policy.plain_call(4, steps, seconds)
    assert 0.036 / 32 < policy.plain[4].seconds(1) < 1.03 * 0.036 / 32
    timed(policy, 4, 2, 0.0025)
    timed(policy, 4, 4, 0.003)
    middling, eager = Acceptance(6, 10), Acceptance(95, 100)
    # 2.18 tokens a 4-wide step: ~725 a second, against the blocks' ~880
    assert policy.choose([(middling, 3)], plain_steps=32, rows=4) == 1
    assert policy.choose([(eager, 3)], plain_steps=32, rows=4) == 4  # 3.71 tokens a step: 1236 a second


def test_new_sequences_start_from_the_acceptance_so_far():
    policy = DraftPolicy(max_drafts=3)
    first = policy.new_sequence()
    assert first.rate == 0.5
    policy.record(first, 1, 20)
    assert policy.new_sequence().rate == policy.overall.rate == 2 / 22


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
    # an EOS that lands inside an accepted draft ends the sequence there; a stop decided on the host too
    eos = plain[0].tokens[len(plain[0].tokens) // 2]
    _, plain_eos = generate(model, reqs, 2, 0, eos_ids=[eos])
    _, speculative_eos = generate(model, reqs, 2, 3, eos_ids=[eos])
    assert [(c.tokens, c.finish_reason) for c in speculative_eos] == [(c.tokens, c.finish_reason) for c in plain_eos]


def test_hybrid_models_refuse_it(tmp_path):
    save_hf_model(make_hf_model("qwen3_next", seed=4), tmp_path)
    model = moe_jax.load_model(tmp_path, backend="host")
    with pytest.raises(InputError, match="recurrent state"):
        GenerationEngine(model, 1, 64, drafts=4)
