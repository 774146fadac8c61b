"""Joining a multi-process run on JAX's distributed runtime, and what crosses between its processes.

How it works and why: docs/INTERNALS.md, moe_jax/distributed.py.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from moe_jax.errors import ConfigError, MoeJaxError
from moe_jax.planning import environment
from moe_jax.planning.environment import COORDINATOR, NUM_PROCESSES, PROCESS_ID

AXIS = "processes"  # the mesh axis over the run's processes (process_mesh)
HEARTBEAT_TIMEOUT_S = 40  # a silent process is dead after this (JAX: 100; a loaded machine can stall 10+ s)
START_TIMEOUT_S = 120  # how long process 0 waits for the others to join


class PeerFailed(MoeJaxError):
    """Another process of the run stopped answering (it died, or was killed)."""


@dataclass(frozen=True)
class World:
    """This process's place in the run."""

    index: int = 0
    count: int = 1

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes the run's outputs."""
        return self.index == 0

    @property
    def several(self) -> bool:
        return self.count > 1

    def share(self, items: list) -> list:
        """This process's share of `items` (every count-th one, from its index): in input order when the shares
        are taken back in turn."""
        return items[self.index :: self.count]

    def rows(self, batch_size: int) -> slice:
        """This process's rows of a global batch of `batch_size` rows."""
        if batch_size % self.count:
            raise ConfigError(
                f"batch_size {batch_size} does not split over {self.count} processes: give a multiple of {self.count}"
            )
        per = batch_size // self.count
        return slice(self.index * per, (self.index + 1) * per)

    def describe(self) -> str:
        return f"process {self.index} of {self.count}"


@dataclass(frozen=True)
class ExpertShard:
    """The experts one process holds: shard `index` of `count` equal shards of every MoE layer."""

    index: int
    count: int

    def experts(self, num_experts: int) -> range:
        if num_experts % self.count:
            raise ConfigError(
                f"{num_experts} experts per layer do not split into {self.count} equal shards: give a divisor of "
                f"{num_experts} (one shard per process)"
            )
        per = num_experts // self.count
        return range(self.index * per, (self.index + 1) * per)

    def describe(self) -> str:
        return f"expert shard {self.index} of {self.count}"


def this_process_shard(count: int) -> ExpertShard | None:
    """This process's shard when the run splits experts `count` ways (one shard per process); None for 1."""
    if count == 1:
        return None
    if count != _world.count:
        raise ConfigError(
            f"expert_shards {count} must equal the run's process count ({_world.count}): each process holds one "
            f"shard (start the run with python -m moe_jax.launch -n {count})"
        )
    return ExpertShard(_world.index, count)


_world = World()  # this process's place, once join() has found it


def world() -> World:
    return _world


def join() -> World:
    """Joins the run the environment describes (the first call; later ones return the same World)."""
    global _world
    if _world.several:
        return _world
    settings = _settings_from_environment()
    if settings is None:
        return _world
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            **settings, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S, initialization_timeout=START_TIMEOUT_S
        )
    except Exception as e:  # JAX raises RuntimeError/XlaRuntimeError kinds; the user needs where and why
        where = settings.get("coordinator_address") or "the cluster's coordinator"
        raise PeerFailed(
            f"could not join the run at {where}: {e} (join before anything else uses JAX: load_model does first)"
        ) from e
    _world = World(jax.process_index(), jax.process_count())
    return _world


def _settings_from_environment() -> dict | None:
    given = environment.distributed()
    if any(given.values()):
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise ConfigError(f"a multi-process run needs {', '.join(missing)} too (set: {_set_names(given)})")
        try:
            count, index = int(given[NUM_PROCESSES]), int(given[PROCESS_ID])
        except ValueError:
            raise ConfigError(f"{NUM_PROCESSES} and {PROCESS_ID} must be integers ({_set_names(given)})") from None
        if not 0 <= index < count:
            raise ConfigError(f"{PROCESS_ID}={index} is not in [0, {NUM_PROCESSES}={count})")
        if count == 1:
            return None
        return {"coordinator_address": given[COORDINATOR], "num_processes": count, "process_id": index}
    tasks = environment.scheduler_tasks()
    if tasks and tasks.isdigit() and int(tasks) > 1:
        return {}  # jax.distributed.initialize finds the coordinator, count and index itself
    return None


def _set_names(given: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in given.items() if v)


def gather(array: np.ndarray) -> np.ndarray:
    """Every process's `array` (same shape and dtype everywhere), stacked in process order: [count, *shape]."""
    if not _world.several:
        return np.asarray(array)[None]
    from jax.experimental import multihost_utils

    try:
        return np.asarray(multihost_utils.process_allgather(np.asarray(array)))
    except Exception as e:  # jax's runtime errors when a peer's connection closes
        raise PeerFailed(
            f"a collective with the other processes failed ({_first_line(e)}); another "
            "process of the run has probably died: see its output"
        ) from e


def sum_over_processes(values: np.ndarray) -> np.ndarray:
    """The sum of every process's float `values`, added in float64 in process order (the same on all)."""
    return gather(np.asarray(values, np.float32)).astype(np.float64).sum(0)


def weighted_mean(tree, weight: float):
    """The mean over processes of a pytree of float arrays, each process's weighted by `weight` (its count of
    what the tree averages): what one process would get over all the processes' items. One collective."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    flat = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves] + [np.ones(1, np.float32)])
    every = gather(flat * np.float32(weight)).astype(np.float64)
    total = every.sum(0)
    out = total[:-1] / total[-1] if total[-1] > 0 else np.zeros_like(total[:-1])
    pieces, start = [], 0
    for x in leaves:
        pieces.append(out[start : start + np.size(x)].reshape(np.shape(x)).astype(np.asarray(x).dtype))
        start += np.size(x)
    return jax.tree.unflatten(treedef, pieces)


def gather_objects(items: list) -> list[list]:
    """Every process's list of JSON-able `items`, in process order."""
    data = np.frombuffer(json.dumps(items).encode(), np.uint8)
    sizes = gather(np.array([data.size], np.int64))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = gather(padded)
    return [json.loads(every[p, : sizes[p]].tobytes()) for p in range(_world.count)]


def process_mesh():
    """A mesh of one device of every process (its first), in process order, on AXIS."""
    import jax
    from jax.sharding import Mesh

    first = {}
    for device in jax.devices():
        first.setdefault(device.process_index, device)
    return Mesh(np.array([first[p] for p in sorted(first)]), (AXIS,))


def barrier():
    """Waits until every process gets here."""
    gather(np.zeros(1, np.int32))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def leave_at_once(code: int):
    """Ends a process of a failed multi-process run without JAX's shutdown handshake (which, with a peer gone,
    aborts with a page of C++ stack after waiting for it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
