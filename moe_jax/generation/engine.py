"""The generation engine: jit-compiled prefill and decode over a KV cache of `slots` rows, continuous batching.

How it works and why: docs/INTERNALS.md, moe_jax/generation/engine.py.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.backends.expert_parallel import same_rows_on_every_process as same_rows
from moe_jax.errors import InputError
from moe_jax.generation.anchor_cache import AnchorCache
from moe_jax.generation.anchor_rows import recurrent_rows, slot_rows, state_stops, store_anchors
from moe_jax.generation.batch import BLOCK_STEPS, Batch, Completion, Job, Request, Sampling, row_bucket
from moe_jax.generation.drafting import prompt_lookup
from moe_jax.generation.prefill_pieces import piece, piece_ends
from moe_jax.generation.speculation import DraftPolicy
from moe_jax.generation.speculative_block import speculative_block
from moe_jax.model.delta_net import prompt_token_counts
from moe_jax.model.layers import native_prefill
from moe_jax.model.served_adapters import adapter_rows
from moe_jax.native.argmax import argmax_tokens
from moe_jax.native.sample import TokenChoice, sample_tokens

__all__ = ["Completion", "EngineStats", "GenerationEngine", "Request"]

TOKEN_BUCKET = 32
PREFILL_CHUNK = 256
CACHE_REFRESH_STEPS = 16  # decode steps between expert cache updates (backend="auto")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class EngineStats:
    """What generation did. One writer per field: the engine counts prefills and calls, the Batch the decode
    steps that ran and the tokens and drafts it took from them."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_calls: int = 0  # dispatches: a block of greedy steps is one
    drafted_tokens: int = 0  # drafts verified by speculative steps
    accepted_tokens: int = 0  # ... and accepted

    @property
    def acceptance(self) -> float | None:
        """The share of verified drafts accepted (None before any)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    def add(self, other: EngineStats):
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class GenerationEngine:
    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        anchor_cache: AnchorCache | None = None,
        block_steps: int = BLOCK_STEPS,
        drafts: int = 0,
        draft_policy: str = "cost",
    ):
        """`drafts`: the most prompt-lookup drafts a sequence's step verifies (0: no speculative decoding), as
        many as `draft_policy` says pay (generation/speculation.py)."""
        if model.expert_shard is not None and model.generation.leader is None:
            raise InputError(
                f"this process holds only {model.expert_shard.describe()}: its generation steps need every process "
                "of the run in step (moe_jax.generation.lockstep.lead on process 0, the others following)"
            )
        self.model, self.slots, self.max_len = model, slots, round_up(max_len, TOKEN_BUCKET)
        self.anchor_cache = anchor_cache
        self.block_steps = block_steps  # greedy decode steps per call in its batches (Batch)
        if drafts and model.config.linear_layers:
            raise InputError(
                "speculative decoding (drafts) is not built for models with linear-attention layers: their "
                "recurrent state would need rolling back past rejected drafts"
            )
        if drafts:
            DraftPolicy(drafts, draft_policy)  # checks both
        self.drafts, self.draft_policy = drafts, draft_policy
        # None: a prefill step as wide as its prompts need (each new width compiles once); else only these widths,
        # the narrowest that holds the prompts (a server compiles them before it opens: no request waits for XLA)
        self.prefill_widths: tuple[int, ...] | None = None
        self.stats = EngineStats()
        self._steps_dispatched = 0  # the expert cache's refresh cadence (steps a block skipped count too)

    @property
    def widest_prefill(self) -> int:
        """The widest prefill step this engine runs: a chunk, or the whole context when that is shorter."""
        return min(PREFILL_CHUNK, self.max_len)

    def slots_that_fit(self) -> int:
        """The engine's slots, fewer if the model's KV budget (its memory split) holds fewer sequences."""
        fit = self.model.kv.slots(self.max_len)
        if fit is None:
            return self.slots
        if fit < 1:
            raise InputError(
                f"the KV cache budget ({self.model.kv.budget_bytes} bytes) holds no {self.max_len}-token sequence "
                f"({self.model.kv.bytes_per_sequence(self.max_len)} bytes); give the KV cache a larger share"
            )
        return min(self.slots, fit)

    def check_fits(self, request: Request, where: str = ""):
        if not request.tokens or len(request.tokens) + request.max_new_tokens > self.max_len:
            raise InputError(
                f"{where}{len(request.tokens)} prompt tokens + {request.max_new_tokens} new tokens do not fit this "
                f"engine's {self.max_len}-token cache (or the prompt is empty)"
            )
        if not 0 <= request.adapter <= len(self.model.served_adapters):
            raise InputError(
                f"{where}adapter index {request.adapter}: the model serves {len(self.model.served_adapters)} adapters"
            )

    def adapter_ids(self, rows: int) -> np.ndarray | None:
        """A step's per-row adapter indices to fill (zeros: none), or None when the model serves no adapters
        (its steps then take none)."""
        return np.zeros(rows, np.int32) if self.model.served_adapters else None

    def anchor_scope(self, request: Request) -> bytes:
        """The anchor cache scope of a request's KV: its own, and apart for each adapter, whose KV is not the
        base model's (a digest: the anchor cache keys its hashes with a scope of at most 64 bytes)."""
        if not request.adapter:
            return request.cache_scope
        return hashlib.blake2b(request.cache_scope + self.model.adapter_scope(request.adapter), digest_size=32).digest()

    def run(
        self,
        requests: list[Request],
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_ids=(),
        should_stop: Callable[[int, list[int]], bool] | None = None,
        on_finish: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """Generates for every request (request i's index is i for `should_stop` and `on_finish`) and returns
        their completions in order."""
        for i, r in enumerate(requests):
            self.check_fits(r, f"request {i}: ")
        results: list[Completion | None] = [None] * len(requests)
        sampling, eos = Sampling(temperature, top_p, top_k), frozenset(eos_ids)

        def job(i: int, request: Request) -> Job:
            def finished(done: Completion):
                results[i] = done
                if on_finish is not None:
                    on_finish(i, done)

            out: list[int] = []

            def on_token(token: int) -> bool:
                out.append(token)
                return should_stop(i, out)

            return Job(request, sampling, on_token if should_stop is not None else None, finished, eos)

        waiting = deque(job(i, r) for i, r in enumerate(requests))
        slots = min(self.slots_that_fit(), len(requests))  # KV rows for what runs, not for an unused batch size
        with self.batch(slots) as batch, gc_paused(), self.model.host_errors():
            while waiting or batch.active:
                free = len(batch.free_slots)
                if free and waiting:
                    batch.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
                start = time.perf_counter()
                batch.step()
                self.stats.decode_s += time.perf_counter() - start
        return results

    @contextlib.contextmanager
    def batch(self, slots: int, shrink: bool = False, block_steps: int | None = None):
        """A Batch of `slots` KV-cache rows over this engine's compiled steps (`shrink`, `block_steps`: see
        Batch; default the engine's), for the time of the block (its KV cache counts as the model's live KV bytes
        meanwhile)."""
        model = self.model
        model.pack_for_decode()  # the plan's packing for native decode products: done by the first batch, once
        model.refresh_expert_cache()
        # the model's jitted steps for its current structure (a memory split that resizes its expert cache
        # changes the structure; the model keeps the steps of each structure it has had)
        self._steps = model.generation.steps()
        with model.kv.held(model.generation.new_caches(slots, self.max_len)) as caches:
            block_steps = self.block_steps if block_steps is None else block_steps
            greedy, sampled = (
                (model.generation.draft_policy(self.drafts, self.draft_policy, sampled) for sampled in (False, True))
                if self.drafts
                else (None, None)
            )
            yield Batch(self, slots, caches, shrink, block_steps, greedy, model.generation.shared_drafts, sampled)

    def decode_step(self, caches, host_tokens, from_host, last_tokens, positions, adapters: np.ndarray | None = None,
                    choice: TokenChoice | None = None):  # fmt: skip
        """Dispatches one decode step for as many slots as `host_tokens` has rows (not waited for; `adapters`: each
        row's served adapter, `adapter_ids`; `choice`: how each row's token is chosen on the device, None: its
        argmax): (logits, the chosen tokens of every slot, caches)."""
        self._count_steps(1)
        args = (self.model.state_leaves(), caches, host_tokens, from_host, last_tokens, positions, adapters, choice)
        return self._steps.decode(*args, rows=self._rows(host_tokens, last_tokens))

    def decode_block(self, caches, host_tokens, from_host, last_tokens, positions, adapters, steps: int, block: int,
                     stop_ids: np.ndarray, watched: np.ndarray, choice: TokenChoice | None = None):  # fmt: skip
        """Dispatches `steps` decode steps in one call (as `decode_step`; `choice`'s draws [block, rows, 2], a row
        of them a step): (their tokens [block, rows] (rows past the steps run zeros), the last step's tokens of
        every slot, caches, the steps run: fewer than `steps` where a `watched` row [rows] made one of `stop_ids`
        [n] (-1 pads; batch.stop_id_array)). `block`: the most steps a call of this batch runs, the compiled
        block's size."""
        self._count_steps(steps)
        args = (self.model.state_leaves(), caches, host_tokens, from_host, last_tokens, positions, adapters)
        rows = self._rows(host_tokens, last_tokens)
        return self._steps.decode_block(
            *args, np.int32(steps), stop_ids, watched, choice, rows=rows, block=max(block, steps)
        )

    def verify(self, caches, tokens, positions, adapters: np.ndarray | None = None):
        """Dispatches a speculative step for as many slots as `tokens` [rows, width] has rows
        (`GenerationSteps.verify`): (the logits after each token [rows, width, vocab], caches)."""
        self._count_steps(1)
        rows = self._rows(tokens, caches[0][0])
        return self._steps.verify(self.model.state_leaves(), caches, tokens, positions, adapters, rows=rows)

    def speculative_block(self, caches, history, first: int, lengths, budget, kept_before, gate, adapters,
                          steps: int, block: int, width: int, stop_ids: np.ndarray, watched: np.ndarray):  # fmt: skip
        """Dispatches up to `steps` speculative steps `width` tokens wide in one call for as many slots as
        `history` has rows (`speculative_block.speculative_block`; `block`: the most steps a call of this batch
        runs): its SpeculativeOutput."""
        self._count_steps(steps)
        rows = self._rows(history, caches[0][0])
        return self._steps.speculative_block(
            *(self.model.state_leaves(), caches, history, np.int32(first), lengths, budget, kept_before, gate),
            *(adapters, np.int32(steps), stop_ids, watched),
            rows=rows,
            block=block,
            width=width,
        )

    def lookup(self, history: np.ndarray, lengths: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's prompt-lookup drafts (`drafting.prompt_lookup`), on the host."""
        drafts, real = self._steps.lookup(history, lengths, count)
        return np.asarray(drafts), np.asarray(real)

    def _count_steps(self, steps: int):
        """Counts a call of up to `steps` decode steps about to run, refreshing the expert cache (values only: the
        compiled step is reused) each CACHE_REFRESH_STEPS."""
        if self._steps_dispatched % CACHE_REFRESH_STEPS + steps >= CACHE_REFRESH_STEPS:
            self.model.refresh_expert_cache()
        self._steps_dispatched += steps
        self.stats.decode_calls += 1

    @staticmethod
    def _rows(given, every_slot) -> int | None:
        """The rows a step computes: `given`'s, or None where it covers every slot."""
        return len(given) if len(given) < len(every_slot) else None

    def _prefill_width(self, tokens: int) -> int:
        """The width of a prefill step for `tokens` tokens a row. Chunked prefill: long prompts go through in
        PREFILL_CHUNK-token steps, so one compiled shape serves every length; fewer tokens take one step of their
        rounded-up width (or the narrowest of `prefill_widths` that holds them)."""
        width = min(PREFILL_CHUNK, round_up(tokens, TOKEN_BUCKET))
        if self.prefill_widths is not None:
            width = min((w for w in self.prefill_widths if w >= width), default=max(self.prefill_widths))
        return width

    def prefill(self, caches, admitted: list[tuple[int, Job]]):
        """Prefills each admitted (slot, job)'s prompt into its slot: (caches, prompt tokens reused from the
        anchor cache per job, next-token logits per job)."""
        start = time.perf_counter()
        suffixes, reused, stops = [], [], []
        for slot, job in admitted:
            tokens = job.request.tokens
            scope = self.anchor_scope(job.request)
            n, prefix = self.anchor_cache.lookup(tokens, scope) if self.anchor_cache else (0, [])
            if n:
                prefix = slot_rows(prefix, round_up(n, TOKEN_BUCKET))
                caches = self.model.run_jitted(self._steps.write_prefix, caches, np.int32(slot), prefix)
            suffixes.append(tokens[n:])
            reused.append(n)
            stops.append(state_stops(self.anchor_cache, self.model.config, tokens, n, scope))
        first_logits = np.zeros((len(admitted), self.model.config.vocab_size), np.float32)
        longest = max(len(s) for s in suffixes)
        width = self._prefill_width(longest)
        ends = [piece_ends(len(suffix), width, stop) for suffix, stop in zip(suffixes, stops, strict=True)]
        states = [{} for _ in admitted]  # per job: recurrent layers' rows at its stops (prompt length -> rows)
        rows = row_bucket(len(admitted))
        adapters = self.adapter_ids(rows)
        for step in range(max(len(e) for e in ends)):
            # as wide as this step's longest piece needs (pieces ending at anchors can be short)
            width = self._prefill_width(max(b - a for a, b in (piece(e, step) for e in ends)))
            slot_ids = np.zeros(rows, np.int32)
            tokens = np.zeros((rows, width), np.int32)
            positions = np.zeros((rows, width), np.int32)
            last = np.zeros(rows, np.int32)
            counts = np.zeros(rows, np.int32)  # real tokens of each row in this step (the rest pads)
            for row in range(rows):
                i = min(row, len(admitted) - 1)  # bucket padding repeats the last row exactly
                a, b = piece(ends[i], step)
                slot_ids[row] = admitted[i][0]
                if adapters is not None:
                    adapters[row] = admitted[i][1].request.adapter
                tokens[row, : b - a] = suffixes[i][a:b]
                positions[row] = reused[i] + a + np.arange(width)
                last[row] = max(b - a - 1, 0)
                counts[row] = b - a
            step_logits, caches = self.model.run_jitted(
                self._steps.prefill,
                self.model.state_leaves(),
                caches,
                slot_ids,
                tokens,
                positions,
                last,
                counts,
                adapters,
            )
            step_logits = np.asarray(step_logits)
            for i, suffix in enumerate(suffixes):
                a, b = piece(ends[i], step)
                if a < b == len(suffix):  # this request's last prompt token
                    first_logits[i] = step_logits[i]
                elif a < b and b in stops[i]:
                    states[i][reused[i] + b] = recurrent_rows(caches, admitted[i][0], self.model.config.linear_layers)
        if self.anchor_cache is not None:
            for (slot, job), saved in zip(admitted, states, strict=True):
                scope = self.anchor_scope(job.request)
                recurrent = self.model.config.linear_layers
                store_anchors(self.anchor_cache, caches, slot, job.request.tokens, scope, saved, recurrent)
        self.stats.prefill_s += time.perf_counter() - start
        self.stats.prefill_tokens += sum(len(s) for s in suffixes)
        return caches, reused, first_logits


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off while generating, back on (and due) after. A full collection walks every
    object of the process, a stall between two decode steps when large libraries are loaded beside a model; a
    generation makes no cycles of its own (its per-step objects go with their references), so this only defers
    others' garbage."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def put_rows(cache, slot_ids, rows):
    """cache with rows[i] in slot slot_ids[i] (a repeated slot gets identical rows: the bucket padding). A gather
    and a select rather than a scatter, which XLA:CPU widens to float32 for a bfloat16 cache."""
    match = jnp.arange(cache.shape[0])[:, None] == slot_ids[None, :]
    return jnp.where(match.any(axis=1)[:, None, None, None], rows[jnp.argmax(match, axis=1)], cache)


def first_rows(caches, rows: int | None):
    """Each layer's cache arrays cut to their first `rows` slots (None, or every slot: as they are)."""
    if rows is None or rows == caches[0][0].shape[0]:
        return caches
    return [tuple(a[:rows] for a in layer) for layer in caches]


def with_first_rows(caches, part, rows: int | None):
    """`caches` with their first `rows` slots replaced by `part` (`first_rows`' counterpart)."""
    if rows is None or rows == caches[0][0].shape[0]:
        return part
    return [
        tuple(a.at[:rows].set(p) for a, p in zip(layer, layer_part, strict=True))
        for layer, layer_part in zip(caches, part, strict=True)
    ]


class GenerationSteps(NamedTuple):
    prefill: Callable
    decode: Callable
    decode_block: Callable
    write_prefix: Callable
    verify: Callable
    speculative_block: Callable
    lookup: Callable


def compile_generation_steps(graphdef, state_treedef, native_argmax: bool):
    """GenerationSteps: the jitted steps of a model with this structure. They take the model's
    state as its list of leaves (`Model.state_leaves`): jit flattens a list in microseconds, an nnx State (its
    keys sorted, its variables unwrapped) takes a visible share of every decode step's dispatch. `native_argmax`:
    the plan's choice for the tokens chosen on the device, greedy and sampled (`ExecutionPlan.argmax`)."""

    def chosen(logits, choice):
        """Each row's token [rows, 1]: its argmax, or as `choice` says (native.sample.TokenChoice)."""
        if choice is None:
            return argmax_tokens(logits, native_argmax)
        return sample_tokens(logits, choice, native_argmax)

    def merged(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(state_treedef, leaves))

    def forward(leaves, caches, tokens, positions, adapters, rows, several=False):
        """The logits of the first `rows` slots' tokens [rows, t] (None: every slot's) and the caches with their
        KV written. `several` tokens a row (a speculative step): the dense products on the native kernels, as a
        prefill's, whose rows are the decode steps' rows (the same sums a token)."""
        with native_prefill() if several else contextlib.nullcontext(), adapter_rows(adapters), same_rows():
            logits, part = merged(leaves)(tokens, positions, first_rows(caches, rows))
        return logits, with_first_rows(caches, part, rows)

    def prefill(leaves, caches, slot_ids, tokens, positions, last, counts, adapters=None):
        """Each row's tokens (`counts` of them real, the rest right padding) into its slot's caches."""
        rows = [tuple(a[slot_ids] for a in layer) for layer in caches]
        # the dense products on the decode steps' packed weights, where the plan packs them
        with native_prefill(), adapter_rows(adapters), prompt_token_counts(counts), same_rows():
            logits, rows = merged(leaves)(tokens, positions, rows, last)
        caches = [
            tuple(put_rows(a, slot_ids, r) for a, r in zip(layer, layer_rows, strict=True))
            for layer, layer_rows in zip(caches, rows, strict=True)
        ]
        return logits[:, 0], caches

    def decode(leaves, caches, host_tokens, from_host, last_tokens, positions, adapters=None, choice=None, rows=None):
        """One token for each of the first `rows` slots (static: a compiled step per count; None: all): the host's token
        where from_host, else the token the previous step chose (last_tokens, all slots), so steps can follow
        each other without the host; each row through its served adapter (`adapters` [rows], or None). Returns
        (logits [rows, vocab], the tokens of all slots chosen from them (their argmax, or as `choice` says),
        caches). Fewer rows than slots read and write those rows' caches only (the copy of their rows costs less
        than computing the idle ones: a server's batch is rarely full)."""
        tokens = jnp.where(from_host, host_tokens, last_tokens[:rows])
        logits, part = forward(leaves, caches, tokens, positions, adapters, rows)
        logits = logits[:, 0]
        return logits, last_tokens.at[:rows].set(chosen(logits, choice)), part

    def decode_block(
        leaves,
        caches,
        host_tokens,
        from_host,
        last_tokens,
        positions,
        adapters,
        steps,
        stop_ids,
        watched,
        choice=None,
        rows=None,
        block=BLOCK_STEPS,
    ):
        """Up to `steps` (traced: one compiled loop for any count up to `block`) decode steps in one call: the
        first as `decode`'s, each next one on the token the one before chose (its argmax, or as `choice` says,
        step i with `choice.draws[i]`) at the next positions; the loop ends early
        after a step in which a `watched` row [rows] made one of `stop_ids` (its EOS: -1 pads), so no step is spent
        on a sequence that has ended. Returns (their tokens [block, rows], zeros past the steps run, the last
        step's tokens of all slots, caches, the steps run). The host dispatches and reads once per block: its
        Python and dispatch ran beside the steps on the same
        cores, and each call's first steps ran slower than a loop's next ones."""
        count = host_tokens.shape[0]
        steps = jnp.minimum(steps, block)

        def go_on(carry):
            i, _, _, _, stopped = carry
            return (i < steps) & ~stopped

        def step(carry):
            i, out, last, caches, _ = carry
            first = from_host & (i == 0)
            drawn = None if choice is None else choice._replace(draws=choice.draws[i])
            _, last, caches = decode(leaves, caches, host_tokens, first, last, positions + i, adapters, drawn, rows)
            tokens = last[:count, 0]
            stopped = (watched & (tokens[:, None] == stop_ids[None, :]).any(axis=1)).any()
            return i + 1, out.at[i].set(tokens), last, caches, stopped

        out = jnp.zeros((block, count), last_tokens.dtype)
        ran, out, last, caches, _ = jax.lax.while_loop(go_on, step, (jnp.int32(0), out, last_tokens, caches, False))
        return out, last, caches, ran

    def verify(leaves, caches, tokens, positions, adapters=None, rows=None):
        """A speculative step: each of the first `rows` slots' (None: all) tokens [rows, width] at consecutive
        `positions` (its last token, then its drafts) through the model at once, their KV written; returns (the
        logits after each token [rows, width, vocab], caches)."""
        return forward(leaves, caches, tokens, positions, adapters, rows, several=True)

    def write_prefix(caches, slot, prefix):
        """Writes each layer's rows (`slot_rows`: the anchor cache's prefix) at the start of one slot."""

        def write(cache, row):
            return jax.lax.dynamic_update_slice(cache, row[None].astype(cache.dtype), (slot, 0, 0, 0))

        return [
            tuple(write(a, row) for a, row in zip(layer, rows, strict=True))
            for layer, rows in zip(caches, prefix, strict=True)
        ]

    return GenerationSteps(
        jax.jit(prefill, donate_argnums=1),
        jax.jit(decode, donate_argnums=1, static_argnames="rows"),
        # XLA's loop-invariant code motion took the embedding gather's float32 convert (XLA:CPU gathers bfloat16
        # in float32) out of the loop onto the whole table every block, which made
        # blocks slower than single steps; without it the convert stays fused into the gather of the rows
        jax.jit(
            decode_block,
            donate_argnums=1,
            static_argnames=("rows", "block"),
            compiler_options={"xla_disable_hlo_passes": "while-loop-invariant-code-motion"},
        ),
        jax.jit(write_prefix, donate_argnums=0),
        jax.jit(verify, donate_argnums=1, static_argnames="rows"),
        jax.jit(
            functools.partial(speculative_block, forward, native_argmax),
            donate_argnums=1,
            static_argnames=("rows", "block", "width"),
            compiler_options={"xla_disable_hlo_passes": "while-loop-invariant-code-motion"},  # as decode_block's
        ),
        jax.jit(prompt_lookup, static_argnums=2),
    )
