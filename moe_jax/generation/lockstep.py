"""Generation over expert shards: every process holds its shard of every layer's experts and a copy of the rest,
and runs each generation step process 0 runs, on the same rows; each MoE layer's output is a sum over processes
(native/process_sum.py). Process 0 owns the batch, scheduling, sampling and anchor cache and sends each step to the
others as it dispatches it (`Leader`); they run it on their own copy of the device state (`follow`).

How it works and why: docs/INTERNALS.md, moe_jax/generation/lockstep.py.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

from moe_jax import distributed, process_links
from moe_jax.cli import EXIT_SYSTEM
from moe_jax.distributed import PeerFailed
from moe_jax.native import process_sum

_SIZE = struct.Struct("<Q")
LOCAL_STEPS = ("lookup",)  # GenerationSteps run on process 0 alone (no MoE layer in them)
FAILED_EXIT_S = 5  # after a peer failed, the time process 0's requests get to report it before the process exits
T = TypeVar("T")


class Handle:
    """An array an earlier step returned, by its number (both sides number every step's array results in order)."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number


class _State:
    """The model's state leaves (each process passes its own)."""


STATE = _State()


def send(s: socket.socket, message):
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    s.sendall(_SIZE.pack(len(data)) + data)


def receive(s: socket.socket, where: str):
    (size,) = _SIZE.unpack(process_links._read(s, _SIZE.size, where))
    return pickle.loads(process_links._read(s, size, where))


class Leader:
    """Process 0's side: the model's generation steps as process 0 calls them, each sent to the others first."""

    def __init__(self, model, links: process_links.Links, on_failure=None):
        self.model, self.links = model, links
        self.failure: PeerFailed | None = None
        self._on_failure = on_failure
        self._numbered: dict[int, tuple[int, weakref.ref]] = {}  # id(array) -> (its handle, the array)
        self._next = 0
        self._freed: list[int] = []  # handles whose arrays process 0 has dropped, told with the next order
        self._lock = threading.Lock()
        self._replies: dict[int, list] = {p: [] for p in links.orders}
        self._replied = threading.Condition()
        self._stopping = False  # set once process 0 ends the run: the links closing then is no failure
        self._watchers = [
            threading.Thread(target=self._watch, args=(p, s), daemon=True, name=f"lockstep-watch-{p}")
            for p, s in links.orders.items()
        ]
        for watcher in self._watchers:
            watcher.start()

    # --- what the engine calls
    def steps(self, steps):
        """`steps` (GenerationSteps) with each step that holds MoE layers run on every process."""
        return type(steps)(
            *(
                fn if name in LOCAL_STEPS else self._mirrored(name, fn)
                for name, fn in zip(steps._fields, steps, strict=True)
            )
        )

    def new_caches(self, slots: int, length: int):
        """Zeroed KV caches for `slots` sequences, made on every process."""
        return self._order("new_caches", (slots, length), {}, lambda: self.model.kv.new_caches(slots, length))

    def metrics(self) -> list[dict]:
        """Each other process's backend metrics since its last report (host busy seconds and calls)."""
        with self._replied:
            for s in self.links.orders.values():
                self._send(s, ("metrics", (), {}, self._take_freed()))
            deadline = time.monotonic() + distributed.HEARTBEAT_TIMEOUT_S
            while not all(self._replies.values()) and self.failure is None:
                if not self._replied.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise PeerFailed("no process answered for its metrics within the heartbeat timeout")
            if self.failure is not None:
                raise self.failure
            return [self._replies[p].pop(0) for p in sorted(self._replies)]

    def stop(self):
        """Tells the others the run is over (they return from `follow`); their links closing is then no failure."""
        self._stopping = True
        for s in self.links.orders.values():
            with contextlib.suppress(OSError):
                self._send(s, ("stop", (), {}, []))

    # --- the orders
    def _mirrored(self, name: str, fn):
        def run(*args, **static):
            return self._order(name, args, static, lambda: fn(*args, **static))

        return run

    def _order(self, name: str, args, static: dict, run_here):
        if self.failure is not None:
            raise self.failure
        state = self.model.state_leaves()
        encoded = jax.tree.map(lambda x: self._encode(x, state), args, is_leaf=lambda x: x is state)
        order = (name, encoded, static, self._take_freed())
        for s in self.links.orders.values():
            self._send(s, order)
        out = run_here()
        self._number(out)
        return out

    def _encode(self, x, state):
        if x is state:
            return STATE
        if isinstance(x, jax.Array):
            known = self._numbered.get(id(x))
            if known is not None and known[1]() is x:
                return Handle(known[0])
            return np.asarray(x)  # made outside the steps (a batch's first tokens): its value
        return x

    def _number(self, out):
        for leaf in jax.tree.leaves(out):
            if isinstance(leaf, jax.Array):
                number, key = self._next, id(leaf)
                self._next += 1
                self._numbered[key] = (number, weakref.ref(leaf, self._dropper(key, number)))

    def _dropper(self, key: int, number: int):
        def dropped(_):
            with self._lock:
                self._freed.append(number)
                if self._numbered.get(key, (None,))[0] == number:
                    del self._numbered[key]

        return dropped

    def _take_freed(self) -> list[int]:
        with self._lock:
            freed, self._freed = self._freed, []
        return freed

    def _send(self, s: socket.socket, message):
        try:
            send(s, message)
        except OSError as e:
            self._failed(PeerFailed(f"an order to another process failed ({e}): it has probably stopped"))
            raise self.failure from None

    # --- the others' answers, and their end
    def _watch(self, peer: int, s: socket.socket):
        where = f"process {peer} of {self.links.world.count}"
        try:
            while True:
                kind, value = receive(s, where)
                if kind == "error":
                    self._failed(PeerFailed(f"{where} failed: {value}"))
                    return
                with self._replied:
                    self._replies[peer].append(value)
                    self._replied.notify_all()
        except (PeerFailed, OSError, EOFError) as e:
            if self._stopping:
                return
            self._failed(e if isinstance(e, PeerFailed) else PeerFailed(f"{where}: its link closed ({e})"))

    def _failed(self, failure: PeerFailed):
        with self._replied:
            if self.failure is not None:
                return
            self.failure = failure
            self._replied.notify_all()
        print(f"error: {self.links.world.describe()}: {failure}", file=sys.stderr, flush=True)
        if self._on_failure is not None:
            self._on_failure(failure)


def run(model, body: Callable[[], T]) -> T | None:
    """`body()` on process 0 of a generation over expert shards (`model.expert_shard`), every step it runs run on
    every process, the others following until it returns; `body()` alone for a model that is not sharded."""
    if model.expert_shard is None:
        return body()
    if not distributed.world().is_main:
        return follow(model)
    with lead(model):
        return body()


def leave_soon(failure: PeerFailed):
    """Another process stopped: the requests in flight fail (their step's sum names it) and get FAILED_EXIT_S to
    tell their clients; then this process exits, whatever its threads wait on."""
    threading.Timer(FAILED_EXIT_S, distributed.leave_at_once, args=(EXIT_SYSTEM,)).start()


@contextlib.contextmanager
def lead(model, on_failure=leave_soon):
    """Process 0 of an expert-parallel run: the block's generation runs on every process (the others in `follow`);
    `on_failure(error)` is called (from a watcher thread) when another process stops or fails: by default this
    process exits FAILED_EXIT_S later (a server would otherwise go on without experts to compute)."""
    links = process_links.connect(distributed.world())
    process_sum.use_links(links)
    leader = Leader(model, links, on_failure)
    model.generation.leader = leader
    try:
        yield leader
    finally:
        leader.stop()
        model.generation.leader = None
        process_sum.use_links(None)
        links.close()


def _decoded(encoded, state: list, held: dict):
    """An order's arguments on this process: its own state leaves, its arrays for the handles."""

    def decode(x):
        if isinstance(x, _State):
            return state
        return held[x.number] if isinstance(x, Handle) else x

    return jax.tree.map(decode, encoded, is_leaf=lambda x: isinstance(x, (Handle, _State)))


def follow(model):
    """A process other than 0 of an expert-parallel run: runs process 0's orders on this process's shard of the
    model until process 0 stops (returns) or fails (raises PeerFailed)."""
    links = process_links.connect(distributed.world())
    process_sum.use_links(links)
    orders = links.orders[0]
    where = f"process 0 of {links.world.count}"
    model.pack_for_decode()  # as process 0's first batch does
    held: dict[int, jax.Array] = {}
    next_handle = 0
    try:
        while True:
            name, encoded, static, freed = receive(orders, where)
            for number in freed:
                held.pop(number, None)
            if name == "stop":
                return
            if name == "metrics":
                send(orders, ("metrics", model.metrics().summary()))
                continue
            args = _decoded(encoded, model.state_leaves(), held)
            try:
                with model.host_errors():
                    if name == "new_caches":
                        out = model.kv.new_caches(*args)
                    else:
                        out = getattr(model.generation.steps(), name)(*args, **static)
            except Exception as e:
                with contextlib.suppress(OSError):
                    send(orders, ("error", f"{type(e).__name__}: {e}"))
                raise
            for leaf in jax.tree.leaves(out):
                if isinstance(leaf, jax.Array):
                    held[next_handle] = leaf
                    next_handle += 1
    finally:
        process_sum.use_links(None)
        links.close()
