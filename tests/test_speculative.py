"""Speculative decoding with prompt-lookup drafts: the drafter, the cost policy, and greedy outputs identical to
plain decoding, token for token, in every family and dtype (drafts accepted, rejected, EOS inside a draft, rows
finishing mid-draft, batches of mixed lengths)."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

import moe_jax
from moe_jax.errors import InputError
from moe_jax.generation import batch as batch_module
from moe_jax.generation.anchor_cache import AnchorCache
from moe_jax.generation.batch import Job, Sampling
from moe_jax.generation.drafting import MAX_NGRAM, NOTHING, SharedDrafts, prompt_lookup
from moe_jax.generation.engine import GenerationEngine, Request
from moe_jax.generation.sampling import sample, sample_past_draft
from moe_jax.generation.speculation import (
    EXPLORE_EVERY,
    EXPLORING_CALLS,
    JUDGED_AFTER,
    MIN_YIELD,
    YIELD_CALLS,
    YIELD_STEPS,
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


def test_prompts_whose_prefix_the_anchor_cache_holds_decode_speculatively_as_greedy(checkpoints):
    # the KV of a prompt's prefix comes from the anchor cache, the rest is prefilled: speculative steps start where
    # the prefill ended and the lookup searches the whole prompt
    model = moe_jax.load_model(checkpoints["qwen3_moe"], backend="host")
    anchor, rng = 7, np.random.default_rng(5)
    prefix = [*rng.integers(8, 96, size=9).tolist(), anchor]
    reqs = [Request(prefix + rng.integers(8, 96, size=n).tolist() * 2, 16) for n in (3, 5, 4)]
    plain = GenerationEngine(model, 2, 64).run(reqs)
    engine = GenerationEngine(
        model, 2, 64, AnchorCache([anchor], budget_bytes=1 << 20), drafts=3, draft_policy="always"
    )
    done = engine.run(reqs)
    assert [c.tokens for c in done] == [c.tokens for c in plain]
    assert sum(c.reused_tokens for c in done) > 0 and engine.stats.accepted_tokens > 0


def test_a_sequence_whose_drafts_are_not_kept_stops_drafting_and_outputs_stay_greedy(checkpoints, monkeypatch):
    # with the gate at its strictest (after one verified draft, all of them must have been kept), most sequences
    # soon draft no more; the ones that do are not slowed by them, and the tokens are greedy decoding's either way
    model = moe_jax.load_model(checkpoints["qwen3_moe"], backend="host")
    reqs = requests(seed=6)
    plain = GenerationEngine(model, 2, 128, block_steps=4).run(reqs)
    free = GenerationEngine(model, 2, 128, block_steps=4, drafts=3, draft_policy="always")
    assert [c.tokens for c in free.run(reqs)] == [c.tokens for c in plain]
    monkeypatch.setattr(batch_module, "GATE_DRAFTS", 1)
    monkeypatch.setattr(batch_module, "GATE_RATE", 1.0)
    gated = GenerationEngine(model, 2, 128, block_steps=4, drafts=3, draft_policy="always")
    assert [c.tokens for c in gated.run(reqs)] == [c.tokens for c in plain]
    assert 0 < gated.stats.drafted_tokens < free.stats.drafted_tokens
    assert gated.stats.accepted_tokens < gated.stats.drafted_tokens


def test_shared_drafts_keep_each_scopes_latest_outputs_apart():
    shared = SharedDrafts(tokens=8, scopes=2)
    shared.add(b"a", [1, 2, 3])
    assert shared.tokens(b"a").tolist() == [NOTHING] * 4 + [1, 2, 3, NOTHING]
    shared.add(b"a", list(range(4, 13)))  # longer than the scope keeps: its last tokens, oldest first
    assert shared.tokens(b"a").tolist() == [6, 7, 8, 9, 10, 11, 12, NOTHING]
    shared.add(b"b", [5])
    assert shared.tokens(b"b").tolist() == [NOTHING] * 6 + [5, NOTHING]
    assert (shared.tokens(b"c") == NOTHING).all()  # another client's: nothing of a's or b's
    shared.add(b"c", [9])  # a third scope: the least recently used one (a) is dropped
    assert (shared.tokens(b"a") == NOTHING).all() and shared.tokens(b"b")[6] == 5


def test_a_sequence_drafts_from_earlier_outputs_of_its_own_scope_only(checkpoints):
    model = moe_jax.load_model(checkpoints["qwen3_moe"], backend="host")
    engine = GenerationEngine(model, 1, 64, drafts=3)
    first = Request([5, 6, 7, 8], 6, cache_scope=b"client a")
    done = []
    with engine.batch(1) as batch:
        for request in (first, Request([9, 10], 4, cache_scope=b"client b"), Request([11], 4, cache_scope=b"client a")):
            batch.admit([Job(request, on_finish=done.append)])
            shared = batch.history[0, : batch.shared_size].tolist()
            if request.cache_scope == b"client b":
                assert shared == [NOTHING] * batch.shared_size  # nothing of client a's output
            elif done:
                assert shared[-7:] == [*done[0].tokens, NOTHING]  # client a's first output, then its own prompt
            assert (
                batch.history[0, batch.shared_size : batch.shared_size + len(request.tokens)].tolist() == request.tokens
            )
            while batch.active:
                batch.step()


def calls(policy, rows, width, steps, seconds, times=JUDGED_AFTER + 1):
    """`times` calls of a width (the first of each kind is left out: it compiles)."""
    for _ in range(times):
        policy.observed(rows, width, steps, seconds)


def test_what_a_wide_call_accepted_tells_every_narrower_width():
    policy = DraftPolicy(max_drafts=7)
    assert policy.widths == (1, 2, 4, 8)
    # 16 sequence-steps of an 8-wide call: two accepted no draft, two one, ..., two all seven
    policy.accepted(1, [2] * 8)
    assert policy.yields[8] == pytest.approx(1 + 28 / 8)
    assert policy.yields[4] == pytest.approx(1 + (0 + 1 + 2 + 3 * 5) * 2 / 16)  # three at most
    assert policy.yields[2] == pytest.approx(1 + 14 / 16)
    policy.accepted(1, [4, 0])  # a 2-wide call tells nothing of wider widths
    assert policy.yields[2] == pytest.approx(1 + 14 / 20) and policy.yields[8] == pytest.approx(4.5)


def test_the_policy_tries_wider_steps_while_they_pay_and_keeps_the_fastest():
    policy = DraftPolicy(max_drafts=7)
    assert policy.choose(rows=1) == 1  # no plain call timed yet
    calls(policy, 1, 1, steps=32, seconds=0.010)  # 3,200 steps a second: 3,200 tokens a sequence
    assert policy.choose(rows=1) == 8  # one call as wide as it gets: what would each width's steps make?
    policy.accepted(1, [2] * 8)  # every width's steps would make enough: 2 wide 1.875 tokens, 4 wide 3.25
    assert policy.choose(rows=1) == 2  # the narrowest is timed first
    assert policy.choose(rows=2) == 1  # another row count is another step, not timed yet
    calls(policy, 1, 2, steps=20, seconds=0.010)
    assert policy.rate(1, 2) == pytest.approx(2000 * 1.875)
    assert policy.choose(rows=1) == 4  # 2 wide beat plain decoding: 4 wide may too
    calls(policy, 1, 4, steps=10, seconds=0.010)
    assert policy.choose(rows=1) == 2  # it did not (3,250): 8 is not timed, 2 is the fastest
    for _ in range(YIELD_CALLS):
        policy.accepted(1, [YIELD_STEPS] + [0] * 7)  # the workload stopped copying: no draft accepted
    assert policy.choose(rows=1) == 1


def test_the_policy_never_chooses_a_width_whose_steps_make_too_few_tokens():
    # timed, 2 wide would look faster (this machine's noise can make it so), but its steps make 1.05 tokens a
    # sequence: a wider step costs more than a plain one, so it cannot pay
    policy = DraftPolicy(max_drafts=3)
    calls(policy, 1, 1, steps=30, seconds=0.010)
    assert policy.choose(rows=1) == 4
    policy.accepted(1, [19, 1, 0, 0])
    assert MIN_YIELD > policy.yields[2] == policy.yields[4] == pytest.approx(1.05)
    calls(policy, 1, 2, steps=36, seconds=0.010)
    assert policy.rate(1, 2) > policy.rate(1, 1) and policy.choose(rows=1) == 1
    for _ in range(YIELD_CALLS):
        policy.accepted(1, [YIELD_STEPS // 5, YIELD_STEPS, 0, 0])  # the workload started copying
    assert policy.choose(rows=1) == 4  # 2 wide is the fastest timed: 4 wide is tried


def test_the_policy_explores_in_runs_and_probes_where_no_width_pays():
    policy = DraftPolicy(max_drafts=3)
    calls(policy, 4, 1, steps=100, seconds=0.010)
    policy.accepted(4, [0, 10, 10, 0])  # drafts pay in tokens a step (2 wide 2.0, 4 wide 2.5)...
    calls(policy, 4, 2, steps=40, seconds=0.010)  # ... but 2 wide is slower than plain calls here
    calls(policy, 4, 4, steps=30, seconds=0.010)  # and so is 4 wide
    chosen = []
    for _ in range(3 * EXPLORE_EVERY):
        chosen.append(policy.choose(rows=4))
        policy.observed(4, chosen[-1], 100 if chosen[-1] == 1 else 30, seconds=0.010)
    # every EXPLORE_EVERY-th decision, EXPLORING_CALLS in a row of the width tried longest ago
    explored = [(i, w) for i, w in enumerate(chosen) if w != 1]
    starts = [EXPLORE_EVERY * k - 1 for k in (1, 2, 3)]
    assert explored == [(s + i, w) for s, w in zip(starts, (2, 4, 2), strict=True) for i in range(EXPLORING_CALLS)][:-3]
    assert policy.step_rates[4, 1] == pytest.approx(100 / 0.010)  # its calls' own: those after a switch left out
    for _ in range(YIELD_CALLS):
        policy.accepted(4, [YIELD_STEPS, 0, 0, 0])  # no width pays now: exploring is one call as wide as it gets
    chosen = [policy.choose(rows=4) for _ in range(2 * EXPLORE_EVERY)]
    # (the exploration under way runs to its end first)
    assert [w for w in chosen if w != 1] == [2] * (EXPLORING_CALLS - 1) + [4, 4]
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
    assert drafted > 0 and policy.timed(4)  # both kinds of call ran


def test_a_batch_with_sampled_jobs_drafts_on_the_host_and_its_greedy_jobs_stay_greedy(checkpoints):
    # greedy jobs beside sampled ones, one of them asking for log-probabilities (its tokens chosen on the host):
    # the host's speculative steps keep drafts while they are the argmax, so their tokens are greedy decoding's
    model = moe_jax.load_model(checkpoints["qwen3_moe"], backend="host")
    reqs = requests(seed=4)[:4]
    plain = GenerationEngine(model, 4, 128).run(reqs)
    engine = GenerationEngine(model, 4, 128, drafts=3, draft_policy="always")
    done, logprobs = {}, []
    kinds = [Sampling(), Sampling(temperature=0.8), Sampling(logprobs=2), Sampling(temperature=0.8, top_p=0.9)]
    with engine.batch(4) as batch:
        jobs = [
            Job(r, kind, on_finish=lambda c, i=i: done.__setitem__(i, c), on_logprobs=logprobs.append)
            for i, (r, kind) in enumerate(zip(reqs, kinds, strict=True))
        ]
        batch.admit(jobs)
        while batch.active:
            batch.step()
    assert done[0].tokens == plain[0].tokens and done[2].tokens == plain[2].tokens
    assert [lp.token for lp in logprobs] == plain[2].tokens  # each of its tokens reported, in order
    assert all(len(done[i].tokens) == reqs[i].max_new_tokens for i in (1, 3))
    assert engine.stats.drafted_tokens > 0


def chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """The p-value of two equal-sized samples' counts over the same categories coming from one distribution."""
    both = (a + b) > 0
    statistic = (((a - b) ** 2)[both] / (a + b)[both]).sum()
    return float(chi2.sf(statistic, both.sum() - 1))


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "draft"), [(1.0, 1.0, 0, 1), (0.7, 0.9, 0, 3), (1.3, 1.0, 3, 0)]
)
def test_a_draft_kept_with_its_probability_leaves_the_distribution_unchanged(temperature, top_p, top_k, draft):
    # the draft the most likely token (kept mostly), a likely one, or one outside the nucleus / top-k (never kept)
    logits = np.log(np.array([0.05, 0.45, 0.3, 0.15, 0.05]))
    rng, draws = np.random.default_rng(0), 20_000
    plain = np.bincount(sample(np.tile(logits, (draws, 1)), rng, temperature, top_p, top_k), minlength=5)
    past = np.bincount(
        [sample_past_draft(logits, draft, rng, temperature, top_p, top_k) for _ in range(draws)], minlength=5
    )
    assert chi_square_p(plain, past) > 1e-3
    # the test can tell: keeping the draft whenever it is likely enough is not the same distribution
    biased = np.bincount(
        [
            draft if logits[draft] > np.log(0.1) else t
            for t in sample(np.tile(logits, (draws, 1)), rng, temperature, top_p, top_k)
        ],
        minlength=5,
    )
    assert logits[draft] < np.log(0.1) or chi_square_p(plain, biased) < 1e-6


def test_sampled_outputs_with_speculation_are_distributed_as_without(checkpoints):
    # a random-weight model repeats itself in short cycles: drafts often are its likely tokens, kept or not as
    # each draw goes; at a low temperature the first tokens spread over few values, each counted often
    model = moe_jax.load_model(checkpoints["qwen3_moe"], backend="host")
    prompt = np.random.default_rng(3).integers(8, 96, size=6).tolist() * 3
    reqs = [Request(prompt, 4, seed=seed) for seed in range(600)]
    outputs = {}
    for drafts in (0, 3):
        engine = GenerationEngine(model, 8, 64, drafts=drafts, draft_policy="always")
        outputs[drafts] = [c.tokens for c in engine.run(reqs, temperature=0.5)]
        if drafts:
            assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
    assert outputs[0] != outputs[3]  # other draws (the draft's own), the same distribution:
    for place in range(4):
        counts = [np.bincount([out[place] for out in outputs[d]], minlength=96) for d in (0, 3)]
        assert chi_square_p(*counts) > 1e-3, place
    pairs = [np.bincount([out[0] * 96 + out[1] for out in outputs[d]], minlength=96 * 96) for d in (0, 3)]
    assert chi_square_p(*pairs) > 1e-3  # and the first two tokens' joint distribution


def test_hybrid_models_refuse_it(tmp_path):
    save_hf_model(make_hf_model("qwen3_next", seed=4), tmp_path)
    model = moe_jax.load_model(tmp_path, backend="host")
    with pytest.raises(InputError, match="recurrent state"):
        GenerationEngine(model, 1, 64, drafts=4)
