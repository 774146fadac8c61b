"""Expert parallel across processes: each process holds and computes one shard of every MoE layer's experts.

How it works and why: docs/INTERNALS.md, moe_jax/backends/expert_parallel.py.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from host_kernels import NOT_ROUTED
from moe_jax import distributed
from moe_jax.native.process_sum import process_sum

ROWS = P(distributed.AXIS)  # each process's own rows
SAME = P()  # the same on every process
# traced in a generation step that every process runs on the same rows (generation/lockstep.py), not in a step
# over processes' own rows (`over_processes`)
_same_rows = contextvars.ContextVar("same_rows", default=False)


@contextlib.contextmanager
def same_rows_on_every_process():
    """Traces the MoE layers of an expert-parallel model for a step every process runs alike, on the same rows
    (generation/lockstep.py): each adds its experts' share and the sum over processes gives the layer's output."""
    token = _same_rows.set(True)
    try:
        yield
    finally:
        _same_rows.reset(token)


def sharded_experts(experts_fn, call, per_shard: int, x_td, ids_tk, weights_tk, lora):
    """experts_fn(call, x, ids, weights, lora) over every process's tokens, with this process's `per_shard`
    experts (ids first..first+per_shard); inside `over_processes`, or in a step of the same rows on every process
    (`same_rows_on_every_process`)."""
    if _same_rows.get():
        local = ids_tk - distributed.world().index * per_shard
        mine = (local >= 0) & (local < per_shard)
        y = experts_fn(call, x_td, jnp.where(mine, local, NOT_ROUTED), weights_tk, lora)
        return process_sum(y, mine.any(axis=1))
    x_all = jax.lax.all_gather(x_td, distributed.AXIS, tiled=True)
    ids_all = jax.lax.all_gather(ids_tk, distributed.AXIS, tiled=True)
    weights_all = jax.lax.all_gather(weights_tk, distributed.AXIS, tiled=True)
    local = ids_all - jax.lax.axis_index(distributed.AXIS) * per_shard
    mine = (local >= 0) & (local < per_shard)
    y_all = experts_fn(call, x_all, jnp.where(mine, local, NOT_ROUTED), weights_all, lora)
    return jax.lax.psum_scatter(y_all, distributed.AXIS, scatter_dimension=0, tiled=True)


def over_processes(fn, in_specs: tuple, out_specs):
    """`fn` run as one step over every process of the run: arguments with spec ROWS are this process's rows of
    the batch, SAME ones this process's copy of something every process holds alike; results likewise (a ROWS
    result comes back as this process's rows). Collectives inside `fn` name distributed.AXIS."""
    mesh = distributed.process_mesh()
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
    held: dict[int, tuple] = {}  # argument position -> (its structure, its leaves, their global arrays)

    def as_global(position: int, arg, spec):
        """`arg` as global arrays; a SAME argument made of the very jax arrays (immutable) of the last call is not
        wrapped again: the model's weights, passed every step."""
        leaves, structure = jax.tree.flatten(arg)
        if position in held:
            last_structure, last_leaves, last_converted = held[position]
            if last_structure == structure and all(a is b for a, b in zip(last_leaves, leaves, strict=True)):
                return last_converted
        converted = _global(arg, spec, mesh)
        if spec == SAME and all(isinstance(x, jax.Array) for x in leaves):
            held[position] = (structure, leaves, converted)
        return converted

    def run(*args):
        global_args = [as_global(i, arg, spec) for i, (arg, spec) in enumerate(zip(args, in_specs, strict=True))]
        return jax.tree.map(lambda x: x.addressable_data(0), mapped(*global_args))

    return run


def _global(tree, spec, mesh):
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, _local(x)), tree)


def _local(x):
    return x if isinstance(x, jax.Array) else np.asarray(x)
