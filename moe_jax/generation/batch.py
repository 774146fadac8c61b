"""The continuous batch: KV-cache slots that sequences enter and leave between decode steps. A job is admitted into a
free slot by prefilling its prompt, each step decodes one token for every slot, and a sequence leaves at EOS, a
stop, its length limit or when cancelled. The engine drives it over a list of requests, the server from its
connections.

How it works and why: docs/INTERNALS.md, moe_jax/generation/batch.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.generation.constraint import Constraint, GrammarDeadEnd
from moe_jax.generation.drafting import SharedDrafts, stops_drafting
from moe_jax.generation.sampling import TokenLogprobs, adjusted_logits, sample, sample_past_draft, token_logprobs
from moe_jax.generation.speculation import DraftPolicy
from moe_jax.native.sample import TokenChoice, host_draws

BLOCK_STEPS = 32  # the most greedy decode steps one call runs (1: no blocks)
HOST_STOP_STEPS = 8  # the most while a job's stop is decided on the host (on_token): its steps past it are lost
GRAMMAR_DEAD_END = "grammar_dead_end"  # a finish reason: its grammar needed a token the vocabulary lacks
STOP_IDS = 4  # stop ids a block is compiled for (more: the next power of two, compiled then)
GATE_DRAFTS, GATE_RATE = 32, 0.1  # a sequence whose first 32 verified drafts were under 10% kept drafts no more


def stop_id_array(ids) -> np.ndarray:
    """The token ids that end a block early (decode_block's stop_ids), padded with -1 to a compiled length."""
    ids = sorted(ids)
    padded = np.full(max(STOP_IDS, 1 << max(len(ids) - 1, 0).bit_length()), -1, np.int32)
    padded[: len(ids)] = ids
    return padded


def row_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class Request:
    tokens: list[int]
    max_new_tokens: int
    seed: int = 0
    cache_scope: bytes = b""  # the anchor cache entries it may read and writes: only those of its own scope
    adapter: int = 0  # the served adapter its rows run through (Model.adapter_index; 0: none)


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str  # "eos", "stop", "length", "cancelled" or GRAMMAR_DEAD_END
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the anchor cache
    seconds: float = 0.0


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    presence_penalty: float = 0.0  # subtracted from the logit of each token generated so far
    frequency_penalty: float = 0.0  # subtracted once for each time a token was generated so far
    logprobs: int | None = None  # report each token's log-probability and this many top ones' (None: none)

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before the choice (sampling.adjusted_logits)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)

    @property
    def on_device(self) -> bool:
        """Whether the token the step chooses on the device (its argmax, or a draw at this temperature, top-p and
        top-k: native.sample) is all the host needs: the logits as they are, no log-probabilities asked for."""
        return not self.adjusts and self.logprobs is None

    @property
    def greedy(self) -> bool:
        """Whether the step's argmax on the device is all the host needs (on_device at temperature 0)."""
        return self.temperature == 0 and self.on_device


@dataclass
class Job:
    """One request as the batch runs it. `on_token(token)` sees each new token but EOS, in order, on the thread
    that drives the batch, and returns True to end the sequence there ("stop"); `on_finish(completion)` is called
    once. `on_logprobs(logprobs)` (with `sampling.logprobs` set) sees each such token's log-probabilities just
    before `on_token` sees it. `cancelled` may be set from any thread: the job leaves its slot before the next step.
    With a `constraint`, each token is chosen among those its grammar allows, and the job ends ("eos") once the
    grammar is complete."""

    request: Request
    sampling: Sampling = Sampling()
    on_token: Callable[[int], bool] | None = None
    on_finish: Callable[[Completion], None] | None = None
    eos_ids: frozenset[int] = frozenset()  # tokens that end it ("eos"): the model's, or none to ignore them
    cancelled: bool = False
    on_logprobs: Callable[[TokenLogprobs], None] | None = None
    constraint: Constraint | None = None  # the grammar its output keeps to (generation.constraint): ends with it

    @property
    def greedy(self) -> bool:
        """Whether the step's argmax on the device is its token (nothing to read or decide on the host)."""
        return self.sampling.greedy and self.constraint is None

    @property
    def device_chosen(self) -> bool:
        """Whether the token the step chooses on the device is its token (greedy, or sampled there with a draw
        from its generator: the host reads only the tokens, and its steps run in blocks as greedy ones do)."""
        return self.sampling.on_device and self.constraint is None


class Draws:
    """A job's uniform draws: its seeded generator's, one a token, whichever side turns it into the token; draws
    taken for a block's steps that it did not run are given back and come next, so a job's tokens do not depend on
    where the blocks of the batch it ran in ended."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.returned: list[float] = []

    def random(self) -> float:
        return self.returned.pop(0) if self.returned else self.rng.random()

    def take(self, n: int) -> np.ndarray:
        kept = self.returned[:n]
        del self.returned[:n]
        return np.concatenate([kept, self.rng.random(n - len(kept))])

    def give_back(self, draws: np.ndarray):
        self.returned[:0] = list(draws)


@dataclass
class _Slot:
    job: Job
    position: int  # where the next token's KV goes
    rng: Draws
    started: float
    reused: int
    out: list[int] = field(default_factory=list)
    fresh: bool = False  # its last token was chosen on the host and not yet fed to a step
    in_history: int = 0  # of `out`, the tokens written into the batch's history (with speculative decoding)
    drafted: int = 0  # its drafts verified so far
    accepted: int = 0  # ... and kept

    def draft_cap(self, most: int) -> int:
        """The most drafts its next speculative step may take: `most`, or none once GATE_DRAFTS of its drafts
        have been verified and fewer than GATE_RATE of them kept (a sequence that does not copy: its drafts would
        only cost verify steps, for it and for the batch)."""
        return 0 if stops_drafting(self.drafted, self.accepted, GATE_DRAFTS, GATE_RATE) else most

    @property
    def length(self) -> int:
        """Its sequence's tokens: the prompt's and those made."""
        return len(self.job.request.tokens) + len(self.out)


@dataclass
class _Step:
    """A dispatched decode step: its logits and the tokens it chose for every slot (device arrays), and the slots
    it decoded for; or a block of `steps` steps, every job's token chosen on the device: no logits, the tokens
    [steps, rows]."""

    logits: jax.Array | None
    tokens: jax.Array
    decoded: dict[int, _Slot]
    steps: int = 1
    ran: jax.Array | None = None  # a block that may end early: the steps it ran (on the device)
    started: float = 0.0  # when it was dispatched (time.perf_counter)
    rows: int = 0  # the rows it computed
    draws: dict[int, np.ndarray] = field(default_factory=dict)  # each sampled slot's draws it was given


class Batch:
    """`slots` KV-cache rows over `engine` (a GenerationEngine whose steps are compiled and whose caches are
    `caches`). Not thread-safe: one thread admits and steps; other threads may only cancel jobs."""

    def __init__(
        self,
        engine,
        slots: int,
        caches,
        shrink: bool = False,
        block_steps: int = BLOCK_STEPS,
        drafts: DraftPolicy | None = None,
        shared_drafts: SharedDrafts | None = None,
        sampled_drafts: DraftPolicy | None = None,
    ):
        """`shrink`: decode only the slots up to the highest one in use (in powers of two, one compiled step
        each) rather than all of them: for a server, whose batch is mostly less than full; a fixed list of
        requests fills its batch but in its last steps, which would compile those steps for little.
        `block_steps`: the most greedy steps per call (1: one step a call). `drafts`: speculative decoding of
        greedy jobs, as wide as this policy chooses (None: off), and of batches with sampled jobs as wide as
        `sampled_drafts` chooses (by default another policy like it), drafting also from the earlier outputs that
        `shared_drafts` keeps (and keeping this batch's there)."""
        self.engine, self.slots, self.caches, self.shrink = engine, slots, caches, shrink
        self.block_steps = block_steps
        self.drafts = drafts
        self.shared_drafts = shared_drafts or SharedDrafts()
        if drafts is not None and sampled_drafts is None:
            sampled_drafts = DraftPolicy(drafts.widths[-1] - 1, "always" if drafts.always else "cost")
        self.sampled_drafts = sampled_drafts
        self.admitted_meanwhile = False  # a prefill ran while the step in flight did: its time is not the step's
        self.last_read = 0.0  # when the last plain step was read (time.perf_counter)
        self.active: dict[int, _Slot] = {}
        self.last_tokens = jnp.zeros((slots, 1), jnp.int32)  # the last dispatched step's tokens, on the device
        self.in_flight: _Step | None = None  # dispatched with every job's token chosen on the device, not yet read
        # what a speculative call's prompt lookup searches for each slot: its scope's earlier outputs, then from
        # `shared_size` on its own sequence (with speculative decoding)
        self.shared_size = self.shared_drafts.size
        self.history = np.zeros((slots, self.shared_size + engine.max_len), np.int32) if drafts is not None else None

    @property
    def free_slots(self) -> list[int]:
        """Free slots, lowest first: sequences stay packed at the low end, where a shrunk step decodes."""
        return [s for s in range(self.slots) if s not in self.active]

    def admit(self, jobs: list[Job]):
        """Prefills `jobs` (at most one per free slot) into free slots and takes each one's first token."""
        admitted = list(zip(self.free_slots, jobs, strict=False))
        if len(admitted) < len(jobs):
            raise ValueError(f"{len(jobs)} jobs for {len(admitted)} free slots")
        if self.drafts is not None and self.in_flight is not None:
            if self.drafts.timed(self.in_flight.rows):
                self.admitted_meanwhile = True  # the prefill will run after it on the device
            else:  # no plain call of its rows timed yet: read it first, its time alone
                self.read_in_flight()
        start = time.perf_counter()
        self.caches, reused, first_logits = self.engine.prefill(self.caches, admitted)
        for (slot, job), row, n in zip(admitted, first_logits, reused, strict=True):
            s = _Slot(job, len(job.request.tokens), Draws(job.request.seed), start, n)
            if self.history is not None:
                scope = self.engine.anchor_scope(job.request)
                self.history[slot, : self.shared_size] = self.shared_drafts.tokens(scope)
                self.history[slot, self.shared_size : self.shared_size + s.length] = job.request.tokens
            self.active[slot] = s
            self.take_chosen(slot, s, row)

    def retire_cancelled(self):
        for slot, s in list(self.active.items()):
            if s.job.cancelled:
                self.finish(slot, s, "cancelled")

    def step(self):
        """Decodes one token for every active slot (or reads the step in flight, when none can use another); with
        speculative decoding, as many as a speculative call keeps where drafts pay (every job greedy: a block of
        steps on the device, `speculate`; else one step whose tokens the host chooses, `speculate_on_host`)."""
        if self.drafts is not None and self.active:
            greedy = all(s.job.greedy for s in self.active.values())
            width = (self.drafts if greedy else self.sampled_drafts).choose(self.step_rows())
            if width > 1:
                self.read_in_flight()  # its tokens are the lookup's to search
                if self.active:
                    (self.speculate if greedy else self.speculate_on_host)(width)
                return
        step = self.dispatch()
        if self.in_flight is not None:
            self.read_timed(self.in_flight)
        # (a block that may end early is read before the next dispatch, whose positions follow from its length)
        pipelined = step is not None and step.ran is None and all(s.job.device_chosen for s in step.decoded.values())
        self.in_flight = step
        if step is not None and not pipelined:
            self.read_in_flight()

    def read_in_flight(self):
        """Reads the step in flight (if any)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self.read_timed(step)

    def read_timed(self, step: _Step):
        """Reads a plain step; with speculative decoding its steps a second are a plain call's, its seconds from
        its dispatch, or where it waited behind the step before it (pipelined), from when that one was read (unless
        a prefill ran meanwhile)."""
        ran = step.steps if step.ran is None else int(step.ran)
        self.read(step)
        now = time.perf_counter()
        if self.drafts is not None and not self.admitted_meanwhile:
            seconds = now - max(step.started, self.last_read)
            greedy = all(s.job.greedy for s in step.decoded.values())
            (self.drafts if greedy else self.sampled_drafts).observed(step.rows, 1, ran, seconds, step.steps > 1)
        self.last_read = now

    def step_rows(self) -> int:
        """The rows a step computes: every slot, or with `shrink` those up to the highest in use (a power of two)."""
        return min(row_bucket(max(self.active) + 1), self.slots) if self.shrink else self.slots

    def speculate(self, width: int):
        """One speculative call (`speculative_block`) for every active slot, read at once: steps of `width` tokens
        a row, its last token and the drafts its prompt lookup found, each slot taking its tokens up to its first
        rejected draft and the model's own token there (exactly greedy decoding's tokens). The KV written for
        rejected drafts lies past the slot's position, where a later step overwrites it before any token attends
        to it. The policy learns the width's cost from the whole call, reading it included: unlike a plain block's,
        none of it overlaps the device's work."""
        start = time.perf_counter()
        rows = self.step_rows()
        lengths, budget = self.lookup_rows(rows)
        steps = self.call_steps(min(budget[slot] for slot in self.active))
        stop_ids, watched = self.stops(rows)
        kept_before = np.zeros((2, rows), np.int32)
        for slot, s in self.active.items():
            kept_before[:, slot] = s.drafted, s.accepted
        result = self.engine.speculative_block(
            self.caches,
            self.history[:rows],
            self.shared_size,
            lengths,
            budget,
            kept_before,
            (np.int32(GATE_DRAFTS), np.float32(GATE_RATE)),
            self.adapters(rows),
            steps,
            self.block_steps,
            width,
            stop_ids,
            watched,
        )
        self.caches = result.caches
        tokens, made = np.asarray(result.tokens), np.asarray(result.made)
        drafted, accepted = np.asarray(result.drafted), np.asarray(result.accepted)
        stats = self.engine.stats
        stats.decode_steps += int(result.ran)
        for slot, s in list(self.active.items()):
            s.drafted, s.accepted = s.drafted + int(drafted[slot]), s.accepted + int(accepted[slot])
            stats.drafted_tokens += int(drafted[slot])
            stats.accepted_tokens += int(accepted[slot])
            s.position += int(made[slot])
            for token in tokens[slot, : made[slot]]:
                self.take(slot, s, int(token), fresh=True)
                stats.decode_tokens += 1
                if self.active.get(slot) is not s:
                    break
        self.drafts.observed(rows, width, int(result.ran), time.perf_counter() - start)
        self.drafts.accepted(rows, np.asarray(result.accepted_counts))
        self.last_read = time.perf_counter()

    def lookup_rows(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's length in the history its prompt lookup searches and the tokens it may still make (free
        rows: one padding token, none), after writing the tokens made since its last speculative call (here,
        not as each comes: plain calls between speculative ones then cost what they cost without speculation)."""
        lengths = np.full(rows, self.shared_size + 1, np.int32)
        budget = np.zeros(rows, np.int32)
        for slot, s in self.active.items():
            lengths[slot], budget[slot] = self.shared_size + s.length, s.job.request.max_new_tokens - len(s.out)
            first = self.shared_size + len(s.job.request.tokens)  # where its output goes
            self.history[slot, first + s.in_history : first + len(s.out)] = s.out[s.in_history :]
            s.in_history = len(s.out)
        return lengths, budget

    def speculate_on_host(self, width: int):
        """One speculative step for a batch with sampled jobs: every active slot's last token and the drafts its
        prompt lookup found through the model at once (`GenerationSteps.verify`), each slot then keeping drafts
        in order as `choose` decides from their logits (greedy: while they are the argmax; sampled: each with its
        probability, the first one refused replaced by a draw without it), and one token of its own after the
        last kept: the tokens come as they would without drafts (the same distribution, not the same draws)."""
        start = time.perf_counter()
        rows = self.step_rows()
        lengths, budget = self.lookup_rows(rows)
        drafts, real = self.engine.lookup(self.history[:rows], lengths, width - 1)
        tokens = np.zeros((rows, width), np.int32)  # rows and places without drafts: padding, their output unread
        positions = np.zeros((rows, width), np.int32)
        offered = {}
        for slot, s in self.active.items():
            offered[slot] = n = int(min(real[slot], budget[slot] - 1, s.draft_cap(width - 1)))
            tokens[slot, : n + 1] = [s.out[-1], *drafts[slot, :n]]
            positions[slot] = s.position + np.arange(width)
        logits, self.caches = self.engine.verify(self.caches, tokens, positions, self.adapters(rows))
        logits = np.asarray(logits)
        stats = self.engine.stats
        stats.decode_steps += 1
        counts = np.zeros(width, np.int64)
        for slot, s in list(self.active.items()):
            kept = 0
            for j in range(offered[slot] + 1):
                draft = int(tokens[slot, j + 1]) if j < offered[slot] else None
                token = self.take_chosen(slot, s, logits[slot, j], draft)
                stats.decode_tokens += token is not None
                if token is None or token != draft or self.active.get(slot) is not s:
                    break
                kept += 1
            s.position += kept + 1
            counts[kept] += 1
            s.drafted, s.accepted = s.drafted + offered[slot], s.accepted + kept
            stats.drafted_tokens += offered[slot]
            stats.accepted_tokens += kept
        self.sampled_drafts.observed(rows, width, 1, time.perf_counter() - start)
        self.sampled_drafts.accepted(rows, counts)

    def call_steps(self, to_go: int) -> int:
        """The steps of a call of steps whose tokens the device chooses where the job nearest its end has `to_go`
        tokens to make: at most a block, and only a few where a job's stop is decided on the host."""
        steps = max(1, min(self.block_steps, to_go))
        if any(s.job.on_token is not None for s in self.active.values()):
            steps = min(steps, HOST_STOP_STEPS)
        return steps

    def stops(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The token ids that end a call of greedy steps early (stop_id_array) and the rows they end it for
        (watched [rows]): every job's EOS, so a job that ends there spends no more steps."""
        watched = np.zeros(rows, bool)
        watched[[slot for slot, s in self.active.items() if s.job.eos_ids]] = True
        return stop_id_array(set().union(*(s.job.eos_ids for s in self.active.values()))), watched

    def adapters(self, rows: int) -> np.ndarray | None:
        """Each row's served adapter (None: the engine serves none)."""
        adapters = self.engine.adapter_ids(rows)
        if adapters is not None:
            for slot, s in self.active.items():
                adapters[slot] = s.job.request.adapter
        return adapters

    def dispatch(self) -> _Step | None:
        """Starts a decode step for the active slots, unless none of them could keep its output (the step in
        flight may already hold the last token a slot is allowed)."""
        pending = self.in_flight.decoded if self.in_flight is not None else {}
        ahead = self.in_flight.steps if self.in_flight is not None else 0
        to_go = [
            s.job.request.max_new_tokens - len(s.out) - (ahead if pending.get(i) is s else 0)
            for i, s in self.active.items()
        ]
        if not any(n > 0 for n in to_go):
            return None
        on_device = all(s.job.device_chosen for s in self.active.values())
        steps = self.call_steps(min(to_go)) if on_device else 1
        rows = self.step_rows()
        host_tokens = np.zeros((rows, 1), np.int32)
        from_host = np.ones((rows, 1), bool)  # free slots compute on padding and are ignored
        positions = np.zeros((rows, 1), np.int32)
        adapters = self.adapters(rows)
        for slot, s in self.active.items():
            if s.fresh:
                host_tokens[slot, 0] = s.out[-1]
            else:  # its next input is the previous step's argmax
                from_host[slot, 0] = False
            s.fresh = False
            positions[slot, 0] = s.position
            s.position += steps
        self.admitted_meanwhile = False
        self.engine.stats.decode_steps += steps  # less those a block skips, once it is read
        choice, taken = self.choice(rows, steps) if on_device else (None, {})
        started = time.perf_counter()
        if steps == 1:
            logits, self.last_tokens, self.caches = self.engine.decode_step(
                self.caches, host_tokens, from_host, self.last_tokens, positions, adapters, choice
            )
            return _Step(logits, self.last_tokens, dict(self.active), started=started, rows=rows)
        stop_ids, watched = self.stops(rows)
        out, self.last_tokens, self.caches, ran = self.engine.decode_block(
            self.caches,
            host_tokens,
            from_host,
            self.last_tokens,
            positions,
            adapters,
            steps,
            self.block_steps,
            stop_ids,
            watched,
            choice,
        )
        return _Step(None, out, dict(self.active), steps, ran if watched.any() else None, started, rows, taken)

    def choice(self, rows: int, steps: int) -> tuple[TokenChoice | None, dict[int, np.ndarray]]:
        """How a call of `steps` steps (one: a single step's, more: a block's, its draws as many as the compiled
        block's steps) chooses each row's token on the device where a job samples: its temperature, top-p and
        top-k and, for each step, the next draw of its generator, the one the host's sampler would have used for
        that token; None where every job is greedy (each row's argmax). With it, each sampled slot's draws, for a
        block that ends early to give back those of the steps it did not run."""
        sampled = {slot: s for slot, s in self.active.items() if not s.job.greedy}
        if not sampled:
            return None, {}
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        draws = np.zeros((1 if steps == 1 else max(self.block_steps, steps), rows))
        taken = {}
        for slot, s in sampled.items():
            sampling = s.job.sampling
            temperature[slot], top_p[slot], top_k[slot] = sampling.temperature, sampling.top_p, sampling.top_k
            draws[:steps, slot] = taken[slot] = s.rng.take(steps)
        bits = host_draws(draws)
        return TokenChoice(temperature, top_p, top_k, bits[0] if steps == 1 else bits), taken

    def read(self, step: _Step):
        """Takes a decode step's tokens for the slots it decoded that are still theirs."""
        mine = {slot: s for slot, s in step.decoded.items() if self.active.get(slot) is s}
        if step.steps > 1:  # a block, every token chosen on the device: each slot's in order, until it ends
            ran = step.steps if step.ran is None else int(step.ran)
            block = np.asarray(step.tokens)[:ran]  # (the block's rows past its steps are zeros)
            for slot, s in mine.items():
                for token in block[:, slot]:
                    self.take(slot, s, int(token), fresh=False)
                    self.engine.stats.decode_tokens += 1
                    if self.active.get(slot) is not s:
                        break
                else:  # a block that ended early: the slot's next position is where it ended
                    s.position -= step.steps - ran
                    if slot in step.draws:
                        s.rng.give_back(step.draws[slot][ran:])
            self.engine.stats.decode_steps -= step.steps - ran
            return
        kinds = {s.job.device_chosen for s in mine.values()}
        chosen = np.asarray(step.tokens)[:, 0] if True in kinds else None  # only what is needed crosses
        logits = np.asarray(step.logits) if False in kinds else None
        for slot, s in mine.items():
            if s.job.device_chosen:  # the step's choice: the next step's input on the device already
                self.take(slot, s, int(chosen[slot]), fresh=False)
            else:
                self.take_chosen(slot, s, logits[slot])
            self.engine.stats.decode_tokens += 1

    def take_chosen(self, slot: int, s: _Slot, row: np.ndarray, draft: int | None = None) -> int | None:
        """Chooses a slot's next token from its logits on the host (`draft`: a guess of it, kept or not as
        `choose` says) and takes it; a job whose grammar cannot go on finishes there ("grammar_dead_end": the
        server answers it with an error, the batch goes on): None."""
        try:
            token = self.choose(s, row, draft)
        except GrammarDeadEnd:
            self.finish(slot, s, GRAMMAR_DEAD_END)
            return None
        self.take(slot, s, token, fresh=True)
        return token

    @staticmethod
    def choose(s: _Slot, row: np.ndarray, draft: int | None = None) -> int:
        """The slot's next token from its logits; with a `draft` (a guess without a model), the draft where the
        model keeps it (greedy: it is the argmax; sampled: `sample_past_draft`), distributed as without it."""
        sampling, constraint = s.job.sampling, s.job.constraint
        adjusted = adjusted_logits(row, sampling, s.out) if sampling.adjusts else row
        if constraint is not None:
            adjusted = constraint.masked(adjusted)
        if sampling.temperature == 0:
            token = int(adjusted.argmax())
        elif draft is None:
            token = int(sample(adjusted[None], s.rng, sampling.temperature, sampling.top_p, sampling.top_k)[0])
        else:
            token = sample_past_draft(adjusted, draft, s.rng, sampling.temperature, sampling.top_p, sampling.top_k)
        if sampling.logprobs is not None and s.job.on_logprobs is not None and token not in s.job.eos_ids:
            s.job.on_logprobs(token_logprobs(row, token, sampling.logprobs))
        if constraint is not None:
            constraint.advance(token)
        return token

    def take(self, slot: int, s: _Slot, token: int, fresh: bool):
        """Appends a slot's next token (fresh: chosen on the host, not yet fed to a step); retires the slot if
        the token ends its sequence."""
        s.out.append(token)
        s.fresh = fresh
        if token in s.job.eos_ids:
            self.finish(slot, s, "eos")
        elif s.job.on_token is not None and s.job.on_token(token):
            self.finish(slot, s, "stop")
        elif s.job.constraint is not None and s.job.constraint.finished:
            self.finish(slot, s, "eos")  # its grammar is complete: nothing more may follow
        elif len(s.out) >= s.job.request.max_new_tokens:
            self.finish(slot, s, "length")

    def finish(self, slot: int, s: _Slot, reason: str):
        del self.active[slot]
        if self.history is not None:
            self.shared_drafts.add(self.engine.anchor_scope(s.job.request), s.out)
        done = Completion(s.out, reason, len(s.job.request.tokens), s.reused, time.perf_counter() - s.started)
        if s.job.on_finish is not None:
            s.job.on_finish(done)
