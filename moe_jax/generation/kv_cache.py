"""A model's KV cache as generation accounts for it: bytes per sequence, the share of the device budget it may take
(`Model.set_memory_split`), what a running generation holds, and the cache arrays themselves."""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

from moe_jax.model.config import ModelConfig
from moe_jax.planning.memory_check import check_fits


class KVCacheMemory:
    def __init__(self, config: ModelConfig, dtype):
        self.config = config
        self.dtype = dtype
        self.budget_bytes: int | None = None  # None: the KV cache is not limited
        self.live_bytes = 0  # held by a running generation

    def bytes_per_sequence(self, max_len: int) -> int:
        values = sum(heads * dim for heads, dim in self.config.kv_cache_dims)
        return self.config.num_layers * max_len * values * np.dtype(self.dtype).itemsize

    def slots(self, max_len: int) -> int | None:
        """How many sequences of `max_len` tokens the budget holds (None: no limit)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes // self.bytes_per_sequence(max_len)

    def new_caches(self, batch: int, length: int) -> list[tuple]:
        """Zeroed caches for `batch` sequences of `length` tokens, after checking they fit in free memory: per layer
        two arrays [batch, heads, length, dim], head-major (see layers.Attention and mla.MLAttention)."""
        check_fits(
            {"KV cache": batch * self.bytes_per_sequence(length)}, f"a KV cache of {batch} sequences x {length} tokens"
        )
        shapes = [(batch, heads, length, dim) for heads, dim in self.config.kv_cache_dims]
        return [tuple(jnp.zeros(shape, self.dtype) for shape in shapes) for _ in range(self.config.num_layers)]

    @contextlib.contextmanager
    def held(self, caches):
        """Counts `caches` as live for the time of the block (a memory split may not shrink the budget below it)."""
        self.live_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
        try:
            yield caches
        finally:
            self.live_bytes = 0
