"""Several LoRA adapters on one base, each generation row using its own (or none): per-request adapters.

How it works and why: docs/INTERNALS.md, moe_jax/model/served_adapters.py.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.model.layers import Frozen, Projection, micro_batch_slice

NO_ADAPTER = 0

# The adapter index of each row of the batch whose generation step is being traced (int32 [rows]), or None.
_ADAPTER_ROWS: contextvars.ContextVar = contextvars.ContextVar("adapter_rows", default=None)


@contextlib.contextmanager
def adapter_rows(ids):
    """While tracing a step over rows whose adapters are `ids` (None: no per-request adapters)."""
    token = _ADAPTER_ROWS.set(ids)
    try:
        yield
    finally:
        _ADAPTER_ROWS.reset(token)


class ServedLoRA(nnx.Module):
    """One projection's served adapters: `a_ir` [in, R], `b_ro` [R, out], `columns` [R] (the adapter index each
    column of A belongs to, 1-based), `scales` [adapters + 1] (alpha / r of each, 0 for index 0)."""

    def __init__(self, a_ir, b_ro, columns, scales):
        self.a = Frozen(jnp.asarray(a_ir, jnp.float32))
        self.b = Frozen(jnp.asarray(b_ro, jnp.float32))
        self.columns = Frozen(jnp.asarray(columns, jnp.int32))
        self.scales = Frozen(jnp.asarray(scales, jnp.float32))

    def row_weights(self, leading_shape: tuple[int, ...]):
        """(mask [*leading, R] in float32: 1 on the columns of each position's adapter, that adapter's scale
        [*leading]) for inputs whose leading axes are `leading_shape` (rows first, as [b, t] or [b * t]), or None
        outside a step with per-request adapters."""
        ids = _ADAPTER_ROWS.get()
        if ids is None:
            return None
        ids = micro_batch_slice(ids)
        per_row = int(np.prod(leading_shape)) // ids.shape[0]
        ids = jnp.repeat(ids, per_row).reshape(leading_shape)
        mask = (ids[..., None] == self.columns[...]).astype(jnp.float32)
        return mask, self.scales[...][ids]

    def update(self, x):
        """What the rows' adapters add to x @ W (float32), or None outside a step with per-request adapters."""
        weights = self.row_weights(x.shape[:-1])
        if weights is None:
            return None
        mask, scale = weights
        u = (x.astype(jnp.float32) @ self.a[...]) * mask
        return scale[..., None] * (u @ self.b[...])


def stack_adapters(adapters: list[tuple[np.ndarray, np.ndarray] | None], scales: list[float]):
    """The ServedLoRA of one projection from each served adapter's (A [in, r], B [r, out]) in order, None where
    that adapter does not target it (its rows' masks are then all zeros: they add exactly nothing); None when
    none does."""
    present = [(index, pair) for index, pair in enumerate(adapters, start=1) if pair is not None]
    if not present:
        return None
    columns = np.concatenate([np.full(a.shape[1], index, np.int32) for index, (a, _) in present])
    a_ir = np.concatenate([a for _, (a, _) in present], axis=1)
    b_ro = np.concatenate([b for _, (_, b) in present], axis=0)
    return ServedLoRA(a_ir, b_ro, columns, [0.0, *scales])


def attach_served(transformer, adapters: list[tuple[dict, float]]):
    """Gives every projection of `transformer` its ServedLoRA (or none) for `adapters`, each a ({projection path:
    (A [in, r], B [r, out])}, scale) in index order (index 1 first), in place; an empty list removes them."""
    scales = [scale for _, scale in adapters]
    for path, module in nnx.iter_modules(transformer):
        if isinstance(module, Projection):
            module.served = stack_adapters([pairs.get(path) for pairs, _ in adapters], scales)
