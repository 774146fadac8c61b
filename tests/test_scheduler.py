"""The server's engine thread without HTTP: jobs from other threads, mixed sampling in one batch, cancellation,
a full queue, and a failing step that fails only its jobs."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

import moe_jax
from moe_jax.generation.batch import Completion, Request, Sampling
from moe_jax.serving.generation import Generation, Mailbox, Prompt
from moe_jax.serving.output_parser import Dialect
from moe_jax.serving.scheduler import EngineStopped, QueueFull, Scheduler, ServedJob

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-moe"


@pytest.fixture(scope="module")
def model():
    return moe_jax.load_model(MODEL)


class Waiter:
    """A job's end, waited for from the test's thread."""

    def __init__(self, request, sampling: Sampling | None = None):
        self.done = threading.Event()
        self.completion = self.error = None
        self.job = ServedJob(request, sampling or Sampling(), None, self._finish, frozenset({2}), on_error=self._fail)

    def _finish(self, completion):
        self.completion = completion
        self.done.set()

    def _fail(self, error):
        self.error = error
        self.done.set()

    def wait(self):
        assert self.done.wait(60)
        return self


@pytest.fixture
def scheduler(model):
    s = Scheduler(model, slots=4, max_len=64, max_queue=2)
    s.start()
    yield s
    s.stop(5)


def test_mixed_greedy_and_sampled_jobs_match_generate(model, scheduler):
    prompts = [model.tokenizer.encode(p) for p in ["copy srel >", "sort wvdk >", "copy abc >", "reverse xyz >"]]
    settings = [Sampling(), Sampling(1.3, 0.9), Sampling(), Sampling(0.8)]
    waiters = [Waiter(Request(p, 12, seed=3)) for p in prompts]
    for w, sampling in zip(waiters, settings, strict=True):
        w.job.sampling = sampling
        scheduler.submit(w.job)
    for w, p, sampling in zip(waiters, prompts, settings, strict=True):
        expected = model.generate(
            [p], max_new_tokens=12, temperature=sampling.temperature, top_p=sampling.top_p, seed=3
        )[0]
        assert w.wait().completion.tokens == expected


def test_cancel_and_full_queue(model, scheduler):
    prompt = model.tokenizer.encode("copy ab >")
    started = threading.Event()

    def first_token(token):
        started.set()
        return False

    # four running to their length (EOS ignored), two waiting: the next is refused
    running = [Waiter(Request(prompt, 50)) for _ in range(4)]
    running[0].job.on_token = first_token
    for w in running:
        w.job.eos_ids = frozenset()
        scheduler.submit(w.job)
    assert started.wait(60)
    waiting = [Waiter(Request(prompt, 5)) for _ in range(2)]
    for w in waiting:
        scheduler.submit(w.job)
    with pytest.raises(QueueFull):
        scheduler.submit(Waiter(Request(prompt, 5)).job)
    running[1].job.cancelled = True
    waiting[0].job.cancelled = True
    assert running[1].wait().completion.finish_reason == "cancelled"
    assert len(running[1].completion.tokens) < 50
    assert waiting[0].wait().completion.finish_reason == "cancelled"
    assert waiting[0].completion.tokens == []
    assert waiting[1].wait().completion.finish_reason in ("eos", "length")
    assert all(w.wait().completion.finish_reason == "length" for w in (running[0], running[2], running[3]))


def test_a_failing_step_fails_its_jobs_and_the_server_goes_on(model, scheduler):
    prompt = model.tokenizer.encode("copy srel >")
    engine, calls = scheduler.engine, []

    def failing_once(step):
        def run(*args):
            if not calls:
                calls.append(1)
                raise RuntimeError("a host kernel failed")
            return step(*args)

        return run

    # the first decode dispatch fails, whichever kind it is (one step, or a greedy block)
    engine.decode_step, engine.decode_block = failing_once(engine.decode_step), failing_once(engine.decode_block)
    try:
        failed = Waiter(Request(prompt, 8))
        scheduler.submit(failed.job)
        assert isinstance(failed.wait().error, RuntimeError)
        after = Waiter(Request(prompt, 8))
        scheduler.submit(after.job)
        assert after.wait().completion.tokens == model.generate([prompt], max_new_tokens=8)[0]
        assert scheduler.stats.failures == 1
    finally:
        del engine.decode_step, engine.decode_block  # the methods again


def test_a_stopped_engine_refuses_new_jobs(model):
    scheduler = Scheduler(model, slots=2, max_len=64)
    scheduler.start()
    scheduler.stop(5)
    with pytest.raises(EngineStopped):
        scheduler.submit(Waiter(Request([1, 2], 4)).job)


def test_each_token_reaches_the_event_loop_as_it_comes():
    """The engine thread's tokens are handed to the connection's event loop as they come, not at the end."""

    async def stream():
        prompt = Prompt([1], None, 8, Sampling(), 0, [], frozenset())
        generation = Generation(
            prompt, lambda ids: "".join("abcdefgh"[i] for i in ids), Dialect(), Mailbox(asyncio.get_running_loop())
        )
        pieces = generation.pieces()
        one_by_one = []
        for token in range(3):
            await asyncio.to_thread(generation.job.on_token, token)  # as the engine thread does
            one_by_one.append((await anext(pieces)).text)

        def rest_of_it():
            for token in range(3, 6):
                generation.job.on_token(token)
            generation.job.on_finish(Completion(list(range(6)), "length", 1))

        await asyncio.to_thread(rest_of_it)
        together = [p.text async for p in pieces]
        return one_by_one, together, generation.completion

    one_by_one, together, completion = asyncio.run(stream())
    assert one_by_one == ["a", "b", "c"]
    assert "".join(together) == "def"  # in as few pieces as the loop's wake-ups took
    assert completion.finish_reason == "length"


def test_after_warm_up_no_prompt_length_compiles_a_prefill(model):
    """The engine thread compiles the narrowest and the widest prefill for every row bucket before it serves,
    and prefills only at those widths after, and the decode steps greedy and sampled: a prompt of any length,
    alone or with others, greedy or sampled, compiles nothing."""
    scheduler = Scheduler(model, slots=4, max_len=96, max_queue=8)
    scheduler.start()
    try:
        steps = model.generation.steps()  # (jitted once per model: earlier tests' shapes are in them)
        compiled = steps.prefill._cache_size(), steps.decode._cache_size()
        assert scheduler.engine.prefill_widths == (32, 96)
        tokens = model.tokenizer.encode("copy abcdefghijklmnopqrstuvwxyz >")
        waiters = [
            Waiter(Request((tokens * 3)[:n], 3), Sampling(temperature=t))
            for n, t in ((5, 0.0), (40, 0.8), (70, 0.0), (33, 1.0))
        ]
        for w in waiters:
            scheduler.submit(w.job)
        assert all(w.wait().completion.finish_reason in ("length", "eos") for w in waiters)
        assert (steps.prefill._cache_size(), steps.decode._cache_size()) == compiled
    finally:
        scheduler.stop(5)
