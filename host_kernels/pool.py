"""A persistent pool of worker threads for expert GEMMs.

How it works and why: docs/INTERNALS.md, host_kernels/pool.py.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from threadpoolctl import ThreadpoolController

from host_kernels.errors import HostKernelError, KernelArgumentError

_blas = ThreadpoolController()


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_running = threading.local()


def current_worker() -> int | None:
    """Index of the pool worker running the calling task (0 is a run's caller), or None outside any task."""
    return getattr(_running, "worker", None)


MAX_THREADS = 4096  # beyond any machine's cores: a larger count is a mistake, not a request


def check_thread_count(threads) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise KernelArgumentError(f"threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")


class WorkerPool:
    def __init__(self, threads: int | None = None):
        if threads is not None:
            check_thread_count(threads)
        self.threads = threads or default_threads()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        # the helpers hold the queue, not the pool: when the pool goes, its finalizer tells them to end (a model
        # freed in a long process left one sleeping thread per engine before)
        self._helpers = [
            threading.Thread(target=_helper_loop, args=(self._tasks,), name=f"host-kernels-{i}", daemon=True)
            for i in range(self.threads - 1)
        ]
        weakref.finalize(self, _stop_helpers, self._tasks, len(self._helpers))
        try:
            for t in self._helpers:
                t.start()
        except RuntimeError as e:  # the OS's thread limit
            raise HostKernelError(f"cannot start {self.threads} worker threads ({e}); ask for fewer") from None

    def run(self, tasks: Sequence[Callable[[], None]]) -> list[float]:
        """Runs every task once; returns each worker's busy seconds (caller first). Raises the first task error."""
        busy = [0.0] * self.threads
        if not tasks:
            return busy
        errors: list[BaseException] = []
        work: queue.SimpleQueue = queue.SimpleQueue()
        for task in tasks:
            work.put(task)
        done = threading.Barrier(min(self.threads, len(tasks)))
        helpers = done.parties - 1
        # one BLAS thread per worker: the pool is the threads asked for (BLAS's own pool would add a thread per
        # core on top, spinning against the other processes' threads)
        with _blas.limit(limits=1, user_api="blas"):
            for worker in range(1, helpers + 1):
                self._tasks.put((work, busy, worker, errors, done))
            self._drain(work, busy, 0, errors)
            done.wait()
        if errors:
            raise errors[0]
        return busy

    @staticmethod
    def _drain(work, busy, worker, errors):
        while True:
            try:
                task = work.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            _running.worker = worker
            try:
                if not errors:  # after a failure, drain without running: the call is lost anyway
                    task()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
            finally:
                _running.worker = None
            busy[worker] += time.perf_counter() - start


def _helper_loop(tasks: queue.SimpleQueue):
    while True:
        job = tasks.get()
        if job is None:  # the pool is gone
            return
        work, busy, worker, errors, done = job
        try:
            WorkerPool._drain(work, busy, worker, errors)
        finally:
            done.wait()


def _stop_helpers(tasks: queue.SimpleQueue, helpers: int):
    for _ in range(helpers):
        tasks.put(None)
