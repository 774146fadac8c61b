"""The generation engine: a KV cache of `slots` rows, jit-compiled prefill and decode, continuous batching.

Each slot holds one sequence. When a sequence finishes, its slot takes the next waiting prompt at once, so the
batch never waits for its slowest member. New prompts are prefilled into their slots (a bucketed number of rows
and tokens, so shapes repeat and compile once), then every step decodes one token for all slots together.
With an anchor cache, a prompt first copies the KV of its longest cached anchor prefix into its slot and prefills
only the rest. Every request samples from its own seeded generator, so its output does not depend on which other
requests share the batch. Greedy steps follow each other on the device, the host one step behind (_Run).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.anchor_cache import AnchorCache
from moe_jax.errors import InputError
from moe_jax.native_call import argmax_tokens
from moe_jax.sampling import sample

TOKEN_BUCKET = 32
PREFILL_CHUNK = 256
CACHE_REFRESH_STEPS = 16  # decode steps between expert cache updates (backend="auto")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class Request:
    tokens: list[int]
    max_new_tokens: int
    seed: int = 0


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the anchor cache
    seconds: float = 0.0


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0

    def add(self, other: EngineStats):
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Slot:
    index: int  # request index
    request: Request
    position: int  # where the next token's KV goes
    rng: np.random.Generator
    started: float
    reused: int
    out: list[int] = field(default_factory=list)
    fresh: bool = False  # its last token was chosen on the host and not yet fed to a step


@dataclass
class _Step:
    """A dispatched decode step: its logits and argmax tokens (device arrays), and the slots it decoded for."""

    logits: jax.Array
    tokens: jax.Array
    decoded: dict[int, _Slot]


class GenerationEngine:
    def __init__(self, model, slots: int, max_len: int, anchor_cache: AnchorCache | None = None):
        self.model, self.slots, self.max_len = model, slots, round_up(max_len, TOKEN_BUCKET)
        self.anchor_cache = anchor_cache
        self.stats = EngineStats()

    def _compile(self):
        """The model's jitted steps for its current structure (a memory split that resizes its expert cache
        changes the structure; the model keeps the steps of each structure it has had)."""
        self._prefill, self._decode, self._write_prefix = self.model.generation_steps()

    def slots_that_fit(self) -> int:
        """The engine's slots, fewer if the model's KV budget (its memory split) holds fewer sequences."""
        fit = self.model.kv_slots(self.max_len)
        if fit is None:
            return self.slots
        if fit < 1:
            raise InputError(
                f"the KV cache budget ({self.model.kv_budget_bytes} bytes) holds no {self.max_len}-token sequence "
                f"({self.model.kv_bytes_per_sequence(self.max_len)} bytes); give the KV cache a larger share"
            )
        return min(self.slots, fit)

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
        model = self.model
        for i, r in enumerate(requests):
            if not r.tokens or len(r.tokens) + r.max_new_tokens > self.max_len:
                raise InputError(
                    f"request {i}: {len(r.tokens)} prompt tokens + {r.max_new_tokens} new tokens do not fit this "
                    f"engine's {self.max_len}-token cache (or the prompt is empty)"
                )
        slots = min(self.slots_that_fit(), len(requests))  # KV rows for what runs, not for an unused batch size
        model.refresh_expert_cache()
        self._compile()
        caches = model.new_caches(slots, self.max_len)
        model.kv_live_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
        try:
            run = _Run(self, requests, slots, (temperature, top_p, top_k), set(eos_ids), should_stop, on_finish)
            with gc_paused(), model.host_errors():
                return run.loop(caches)
        finally:
            model.kv_live_bytes = 0

    def _admit(self, caches, admitted, requests, active):
        """Prefills newly admitted requests into their slots; returns (caches, next-token logits per request)."""
        start = time.perf_counter()
        suffixes = []
        for slot, index in admitted:
            request = requests[index]
            reused, prefix = self.anchor_cache.lookup(request.tokens) if self.anchor_cache else (0, [])
            if reused:
                padded = round_up(reused, TOKEN_BUCKET)
                prefix = [(_pad(k, padded), _pad(v, padded)) for k, v in prefix]
                caches = self.model.run_jitted(self._write_prefix, caches, np.int32(slot), prefix)
            suffixes.append(request.tokens[reused:])
            active[slot] = _Slot(
                index, request, len(request.tokens), np.random.default_rng(request.seed), start, reused
            )
        first_logits = np.zeros((len(admitted), self.model.config.vocab_size), np.float32)
        longest = max(len(s) for s in suffixes)
        # chunked prefill: long prompts go through in PREFILL_CHUNK-token steps, so one compiled shape
        # serves every length; shorter prompts use one step of their rounded-up width
        width = min(PREFILL_CHUNK, round_up(longest, TOKEN_BUCKET))
        rows = row_bucket(len(admitted))
        for chunk_start in range(0, longest, width):
            slot_ids = np.zeros(rows, np.int32)
            tokens = np.zeros((rows, width), np.int32)
            positions = np.zeros((rows, width), np.int32)
            last = np.zeros(rows, np.int32)
            for row in range(rows):
                i = min(row, len(admitted) - 1)  # bucket padding repeats the last row exactly
                slot, suffix = admitted[i][0], suffixes[i][chunk_start : chunk_start + width]
                slot_ids[row] = slot
                tokens[row, : len(suffix)] = suffix
                positions[row] = active[slot].reused + chunk_start + np.arange(width)
                last[row] = max(len(suffix) - 1, 0)
            step_logits, caches = self.model.run_jitted(
                self._prefill, self.model.state_leaves(), caches, slot_ids, tokens, positions, last
            )
            step_logits = np.asarray(step_logits)
            for i, suffix in enumerate(suffixes):
                if chunk_start < len(suffix) <= chunk_start + width:  # this request's last prompt token
                    first_logits[i] = step_logits[i]
        if self.anchor_cache is not None:
            for slot, index in admitted:
                self._store_anchors(caches, slot, requests[index].tokens)
        self.stats.prefill_s += time.perf_counter() - start
        self.stats.prefill_tokens += sum(len(s) for s in suffixes)
        return caches, first_logits

    def _store_anchors(self, caches, slot, tokens):
        rows = None

        def kv_of_range(start, end):
            nonlocal rows
            if rows is None:  # one device-to-host copy of the slot's rows, only when a segment is new
                rows = [(np.asarray(k[slot]), np.asarray(v[slot])) for k, v in caches]
            # the anchor cache holds token-major segments [n, kv, hd]; the engine's cache is [kv, s, hd] a row
            return [(k[:, start:end].swapaxes(0, 1), v[:, start:end].swapaxes(0, 1)) for k, v in rows]

        self.anchor_cache.store(tokens, kv_of_range)


class _Run:
    """One GenerationEngine.run: admit waiting requests into free slots, decode a step for every active slot, take
    each slot's next token, retire the finished.

    Greedy decoding keeps one step in flight: a step's argmax tokens feed the next step on the device, and the host
    reads them (and checks EOS, stop strings, lengths) while that next step runs, so Python and the device-to-host
    copy stay off the critical path (bench model, interleaved against reading every step at once: 12-14% more
    tokens/s at batch 16 and at batch 1). A slot that finished on the token read last has had one more step
    computed for it; that output is dropped, and a step still in flight when every sequence has ended is left to
    finish unread. Sampling reads each step's logits at once: its tokens come from each request's own generator
    on the host."""

    def __init__(self, engine, requests, slots, sampling, eos, should_stop, on_finish):
        self.engine, self.requests, self.slots = engine, requests, slots
        self.temperature, self.top_p, self.top_k = sampling
        self.greedy = self.temperature == 0
        self.eos, self.should_stop, self.on_finish = eos, should_stop, on_finish
        self.active: dict[int, _Slot] = {}
        self.results: list[Completion | None] = [None] * len(requests)
        self.last_tokens = jnp.zeros((slots, 1), jnp.int32)  # the last dispatched step's argmax, on the device
        self.in_flight: _Step | None = None  # greedy: dispatched, not yet read

    def loop(self, caches) -> list[Completion]:
        engine, active = self.engine, self.active
        waiting = deque(range(len(self.requests)))
        while waiting or active:
            free = [s for s in range(self.slots) if s not in active]
            admitted = []
            while free and waiting:
                admitted.append((free.pop(0), waiting.popleft()))
            if admitted:
                caches, first_logits = engine._admit(caches, admitted, self.requests, active)
                for (slot, _), row in zip(admitted, first_logits, strict=True):
                    self.take(slot, active[slot], self.choose(active[slot], row), fresh=True)
            start = time.perf_counter()
            step, caches = self.dispatch(caches)
            if self.in_flight is not None:
                self.read(self.in_flight)
            self.in_flight = step if self.greedy else None
            if step is not None and not self.greedy:
                self.read(step)
            engine.stats.decode_s += time.perf_counter() - start
        return self.results

    def dispatch(self, caches) -> tuple[_Step | None, list]:
        """Starts a decode step for the active slots, unless none of them could keep its output (the step in
        flight may already hold the last token a slot is allowed)."""
        pending = self.in_flight.decoded if self.in_flight is not None else {}
        if not any(len(s.out) + (pending.get(i) is s) < s.request.max_new_tokens for i, s in self.active.items()):
            return None, caches
        engine, model = self.engine, self.engine.model
        if engine.stats.decode_steps % CACHE_REFRESH_STEPS == CACHE_REFRESH_STEPS - 1:
            model.refresh_expert_cache()  # values only: the compiled step is reused
        host_tokens = np.zeros((self.slots, 1), np.int32)
        from_host = np.ones((self.slots, 1), bool)  # free slots compute on padding and are ignored
        positions = np.zeros((self.slots, 1), np.int32)
        for slot, s in self.active.items():
            if s.fresh:
                host_tokens[slot, 0] = s.out[-1]
            else:  # its next input is the in-flight step's argmax
                from_host[slot, 0] = False
            s.fresh = False
            positions[slot, 0] = s.position
            s.position += 1
        logits, self.last_tokens, caches = engine._decode(
            model.state_leaves(), caches, host_tokens, from_host, self.last_tokens, positions
        )
        engine.stats.decode_steps += 1
        return _Step(logits, self.last_tokens, dict(self.active)), caches

    def read(self, step: _Step):
        """Takes a decode step's tokens for the slots it decoded that are still theirs."""
        if self.greedy:  # the step's argmax: already fed to the step after it
            chosen = np.asarray(step.tokens)[:, 0]
        else:
            logits = np.asarray(step.logits)
        for slot, s in step.decoded.items():
            if self.active.get(slot) is s:
                token = int(chosen[slot]) if self.greedy else self.choose(s, logits[slot])
                self.take(slot, s, token, fresh=not self.greedy)
                self.engine.stats.decode_tokens += 1

    def choose(self, s: _Slot, row: np.ndarray) -> int:
        if self.greedy:
            return int(row.argmax())
        return int(sample(row[None], s.rng, self.temperature, self.top_p, self.top_k)[0])

    def take(self, slot: int, s: _Slot, token: int, fresh: bool):
        """Appends a slot's next token (fresh: chosen on the host, not yet fed to a step); retires the slot if
        the token ends its sequence."""
        s.out.append(token)
        s.fresh = fresh
        reason = None
        if token in self.eos:
            reason = "eos"
        elif self.should_stop is not None and self.should_stop(s.index, s.out):
            reason = "stop"
        elif len(s.out) >= s.request.max_new_tokens:
            reason = "length"
        if reason:
            del self.active[slot]
            done = Completion(s.out, reason, len(s.request.tokens), s.reused, time.perf_counter() - s.started)
            self.results[s.index] = done
            if self.on_finish is not None:
                self.on_finish(s.index, done)


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off while generating, back on (and due) after. A full collection walks every
    object of the process: ~240 ms with transformers and torch loaded beside a model, a stall between two decode
    steps; a generation makes no cycles of its own (its per-step objects go with their references), so this only
    defers others' garbage. Batch-16 bench generation in such a process: 3% more tokens/s."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _pad(array: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros((length, *array.shape[1:]), array.dtype)
    out[: len(array)] = array
    return out


def put_rows(cache, slot_ids, rows):
    """cache with rows[i] in slot slot_ids[i] (a repeated slot gets identical rows: the bucket padding). A gather
    and a select rather than a scatter, which XLA:CPU widens to float32 for a bfloat16 cache."""
    match = jnp.arange(cache.shape[0])[:, None] == slot_ids[None, :]
    return jnp.where(match.any(axis=1)[:, None, None, None], rows[jnp.argmax(match, axis=1)], cache)


def compile_generation_steps(graphdef, state_treedef, native_argmax: bool):
    """(prefill, decode, write_prefix): the jitted steps of a model with this structure. They take the model's
    state as its list of leaves (`Model.state_leaves`): jit flattens a list in microseconds, an nnx State (its
    keys sorted, its variables unwrapped) in ~150 us of every decode step's dispatch. `native_argmax`: the plan's
    choice for greedy tokens (`ExecutionPlan.argmax`)."""

    def merged(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(state_treedef, leaves))

    def prefill(leaves, caches, slot_ids, tokens, positions, last):
        rows = [(k[slot_ids], v[slot_ids]) for k, v in caches]
        logits, rows = merged(leaves)(tokens, positions, rows, last)
        caches = [
            (put_rows(k, slot_ids, rk), put_rows(v, slot_ids, rv))
            for (k, v), (rk, rv) in zip(caches, rows, strict=True)
        ]
        return logits[:, 0], caches

    def decode(leaves, caches, host_tokens, from_host, last_tokens, positions):
        """One token for every slot: the host's where from_host, else the previous step's argmax (last_tokens),
        so greedy steps can follow each other without the host. Returns (logits, argmax tokens, caches)."""
        tokens = jnp.where(from_host, host_tokens, last_tokens)
        logits, caches = merged(leaves)(tokens, positions, caches)
        logits = logits[:, 0]
        return logits, argmax_tokens(logits, native_argmax), caches

    def write_prefix(caches, slot, prefix):
        """Writes token-major prefixes [n, kv, hd] (the anchor cache's segments) into one slot's rows."""

        def write(cache, prefix_skd):
            return jax.lax.dynamic_update_slice(
                cache, prefix_skd.swapaxes(0, 1)[None].astype(cache.dtype), (slot, 0, 0, 0)
            )

        return [(write(k, pk), write(v, pv)) for (k, v), (pk, pv) in zip(caches, prefix, strict=True)]

    return (
        jax.jit(prefill, donate_argnums=1),
        jax.jit(decode, donate_argnums=1),
        jax.jit(write_prefix, donate_argnums=0),
    )
