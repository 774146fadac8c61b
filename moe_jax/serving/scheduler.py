"""The server's engine thread: one continuous batch shared by every connection.

Connections submit jobs from the event loop's thread; the engine thread takes them between decode steps, admits
as many as there are free slots (the rest wait, up to `max_queue`), steps the batch while anything runs, and
sleeps on the queue when nothing does. A job cancelled by its connection leaves its slot before the next step.
A step that raises fails the jobs it held (each one's `on_error`) and the batch starts afresh with a new KV
cache; the thread itself never dies of a request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from moe_jax.generation.batch import Batch, Completion, Job, Request, Sampling
from moe_jax.generation.engine import TOKEN_BUCKET, GenerationEngine

log = logging.getLogger("moe_jax.serve")
IDLE_POLL_S = 0.05  # how often an idle engine thread looks for a stop request
ARRIVAL_GAP_S = 0.005  # an idle batch waits this long for another request before starting on those it has,
ARRIVAL_WINDOW_S = 0.025  # and no longer than this in all (what a lone request's first token may wait)
# one decode step a call: a client streams each token as it comes, and a request that arrives joins at the next
# step (batch.BLOCK_STEPS greedy steps a call would hold both up to a block)
SERVED_BLOCK_STEPS = 1


STOPPED_MESSAGE = "the server is shutting down"


class QueueFull(Exception):
    """More jobs are waiting than the server accepts."""


class EngineStopped(Exception):
    """The engine thread has ended (the server is stopping, or it could not go on)."""


@dataclass
class ServedJob(Job):
    """A job with what the server needs besides: who to tell when it could not run."""

    on_error: Callable[[BaseException], None] | None = None
    ended: bool = False


@dataclass
class SchedulerStats:
    """What the engine thread has done, read by the metrics endpoint (plain numbers: reads need no lock)."""

    running: int = 0
    waiting: int = 0
    steps: int = 0
    failures: int = 0


class Scheduler:
    def __init__(self, model, slots: int, max_len: int, anchor_cache=None, max_queue: int = 256, drafts: int = 0):
        self.engine = GenerationEngine(model, slots, max_len, anchor_cache, drafts=drafts)
        self.slots = self.engine.slots_that_fit()
        self.max_queue = max_queue
        self.stats = SchedulerStats()
        self.on_step: Callable[[int], None] | None = None  # on the engine thread after each step: its rows
        self._inbox: queue.Queue[ServedJob] = queue.Queue()
        self._held = 0  # submitted and not yet ended: running or waiting
        self._dead = False  # the engine thread ended on an error
        self._last_rows = 0  # sequences in the last decode step
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._deadline = float("inf")  # stopping: running jobs are cancelled after this (time.monotonic)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moe_jax-engine", daemon=True)

    def start(self):
        """Starts the engine thread and waits until its batch exists and its steps are compiled (a first request
        does not wait for compilation); raises what kept it from starting."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def submit(self, job: ServedJob):
        """Queues a job; QueueFull when more than `max_queue` would wait for a slot, EngineStopped when no engine
        thread runs."""
        with self._lock:  # the inbox is written under the lock: a dying engine thread drains what got in
            if self._stopping.is_set():  # the same answer as the requests already waiting get
                raise EngineStopped(STOPPED_MESSAGE)
            if self._dead:
                raise EngineStopped("the generation engine is not running (it failed; see the server's log)")
            if self._held >= self.max_queue + self.slots:
                raise QueueFull(f"{self._held - self.slots} requests are waiting (--max-queue {self.max_queue})")
            self._held += 1
            job.on_finish, job.on_error = self._released(job, job.on_finish), self._released(job, job.on_error)
            self._inbox.put(job)

    def _released(self, job: ServedJob, callback):
        """`callback`, once the job is counted out of the server; a job ends once, through on_finish or
        on_error (a step that fails after a job finished in it does not fail that job)."""

        def ended(value):
            with self._lock:
                if job.ended:
                    return
                job.ended = True
                self._held -= 1
            if callback is not None:
                callback(value)

        return ended

    def begin_stop(self, timeout_s: float = 30.0):
        """From now on refuses new jobs and fails waiting ones (EngineStopped); running jobs get `timeout_s` to
        finish and then fail the same way. Returns at once; the first call sets the deadline. Takes no lock: a
        signal handler calls it, on a thread that may hold one."""
        if not self._stopping.is_set():
            self._deadline = time.monotonic() + timeout_s
            self._stopping.set()

    def stop(self, timeout_s: float = 30.0):
        """`begin_stop`, then waits for the engine thread to end."""
        self.begin_stop(timeout_s)
        if self._thread.is_alive():
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 10 * IDLE_POLL_S)

    def _run(self):
        waiting: deque[ServedJob] = deque()
        while True:  # a new batch (a fresh KV cache) after a failed step
            try:
                with self.engine.batch(self.slots, shrink=True, block_steps=SERVED_BLOCK_STEPS) as batch:
                    if not self._started.is_set():
                        self._warm_up(batch)
                        self._started.set()
                    if self._serve(batch, waiting):
                        return
            except BaseException as error:
                if not self._started.is_set():
                    self._start_error = error
                    self._started.set()
                    return
                log.exception("the engine thread cannot go on; its requests get an error")
                with self._lock:
                    self._dead = True
                self._collect(waiting, block=False)
                for job in waiting:
                    job.on_error(error)
                return

    def _warm_up(self, batch: Batch):
        """Compiles the decode steps (greedy, and sampled on the device: another compiled step), and the prefill
        of the narrowest and the widest prompt chunk, for every number of rows admission can bucket (1, 2, 4, ...
        slots); from then on the engine prefills only at those widths (a prompt in between runs in the wider one):
        requests arrive a few at a time, and each new shape would otherwise stall every client for its
        compilation."""
        self.engine.prefill_widths = (TOKEN_BUCKET, self.engine.widest_prefill)
        for width in sorted(set(self.engine.prefill_widths)):
            prompt = [0] * (width - TOKEN_BUCKET + 1)  # (the shortest prompt that needs this width)
            rows = 1
            while True:
                for sampling in (Sampling(), Sampling(temperature=1.0)):
                    batch.admit([ServedJob(Request(prompt, 2), sampling) for _ in range(min(rows, self.slots))])
                    while batch.active:
                        batch.step()
                if rows >= self.slots:
                    break
                rows *= 2
        self.engine.stats = type(self.engine.stats)()

    def _serve(self, batch: Batch, waiting: deque) -> bool:
        """Runs the batch until the server stops (True) or a step fails (False: the jobs it held are told)."""
        model = self.engine.model
        while True:
            self._collect(waiting, block=not batch.active and not waiting)
            self._drop(waiting, [j for j in waiting if j.cancelled])
            if self._stopping.is_set():
                self._refuse(waiting, list(waiting))
                if time.monotonic() > self._deadline:
                    for s in batch.active.values():
                        self._refuse_running(s.job)
            batch.retire_cancelled()
            if self._stopping.is_set() and not batch.active:
                return True
            admitted = [waiting.popleft() for _ in range(min(len(batch.free_slots), len(waiting)))]
            try:
                with model.host_errors():
                    if admitted:
                        batch.admit(admitted)
                    if batch.active:
                        self._step(batch)
            except Exception as error:  # the step's jobs hear of it; the server goes on with a new batch
                self.stats.failures += 1
                log.exception("a generation step failed; its requests get an error")
                failed = {id(s.job): s.job for s in batch.active.values()}
                failed.update((id(j), j) for j in admitted)
                for job in failed.values():
                    if job.on_error is not None:
                        job.on_error(error)
                self.stats.running = 0
                return False
            self.stats.running, self.stats.waiting = len(batch.active), len(waiting)

    def _step(self, batch: Batch):
        rows = self._last_rows = len(batch.active)
        batch.step()
        self.stats.steps += 1
        if self.on_step is not None:
            self.on_step(rows)

    def _collect(self, waiting: deque, block: bool):
        """Moves submitted jobs into `waiting`. When `block` (the batch is idle), first waits a moment for one,
        then, if the batch last ran more than one sequence, for as long as more keep coming within ARRIVAL_GAP_S,
        up to a batch: clients answered together come back together, a few milliseconds apart, and one prefill of
        them all costs far less than a prefill of the first alone and another of the rest. A lone client's request
        does not wait."""
        if block:
            try:
                waiting.append(self._inbox.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return
            if self._last_rows <= 1:
                return self._collect(waiting, block=False)
            deadline = time.monotonic() + ARRIVAL_WINDOW_S
            while len(waiting) < self.slots and time.monotonic() < deadline:
                try:
                    waiting.append(self._inbox.get(timeout=ARRIVAL_GAP_S))
                except queue.Empty:
                    break
        while True:
            try:
                waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    @staticmethod
    def _refuse_running(job: ServedJob):
        job.on_error(EngineStopped(STOPPED_MESSAGE))
        job.cancelled = True  # its slot is freed before the next step

    def _refuse(self, waiting: deque, jobs: list[ServedJob]):
        """Waiting jobs that will not run: the server is stopping."""
        for job in jobs:
            waiting.remove(job)
            job.on_error(EngineStopped(STOPPED_MESSAGE))

    def _drop(self, waiting: deque, jobs: list[ServedJob]):
        """Jobs their clients cancelled before they ran finish as cancelled."""
        for job in jobs:
            waiting.remove(job)
            job.cancelled = True
            if job.on_finish is not None:
                job.on_finish(Completion([], "cancelled", len(job.request.tokens)))
