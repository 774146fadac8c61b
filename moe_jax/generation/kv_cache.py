"""A model's KV cache as generation accounts for it: bytes per sequence, the share of the device budget it may take
(`Model.set_memory_split`), what a running generation holds, and the cache arrays themselves. A linear-attention
layer (Qwen3-Next's Gated DeltaNet) caches a fixed-size state instead of keys and values: it counts here too."""

from __future__ import annotations

import contextlib
import math

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

    def layer_arrays(self, layer: int, length: int) -> list[tuple[tuple[int, ...], object]]:
        """(shape after the batch axis, dtype) of each array a layer caches for a sequence of `length` tokens:
        keys and values [heads, length, dim] (head-major: see layers.Attention and mla.MLAttention), or a
        linear-attention layer's convolution inputs [1, kernel - 1, channels] and recurrent state [v_heads, k_dim,
        v_dim] in float32 (model/delta_net.py)."""
        if self.config.is_linear_layer(layer):
            s = self.config.linear_attention
            conv = ((1, s.conv_kernel - 1, s.conv_dim), self.dtype)
            return [conv, ((s.num_v_heads, s.k_head_dim, s.v_head_dim), jnp.float32)]
        return [((heads, length, dim), self.dtype) for heads, dim in self.config.kv_cache_dims]

    def bytes_per_sequence(self, max_len: int) -> int:
        return sum(
            math.prod(shape) * np.dtype(dtype).itemsize
            for layer in range(self.config.num_layers)
            for shape, dtype in self.layer_arrays(layer, max_len)
        )

    def slots(self, max_len: int) -> int | None:
        """How many sequences of `max_len` tokens the budget holds (None: no limit)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes // self.bytes_per_sequence(max_len)

    def new_caches(self, batch: int, length: int) -> list[tuple]:
        """Zeroed caches for `batch` sequences of `length` tokens, after checking they fit in free memory: per layer
        two arrays [batch, ...] (`layer_arrays`)."""
        check_fits(
            {"KV cache": batch * self.bytes_per_sequence(length)}, f"a KV cache of {batch} sequences x {length} tokens"
        )
        return [
            tuple(jnp.zeros((batch, *shape), dtype) for shape, dtype in self.layer_arrays(layer, length))
            for layer in range(self.config.num_layers)
        ]

    @contextlib.contextmanager
    def held(self, caches):
        """Counts `caches` as live for the time of the block (a memory split may not shrink the budget below it)."""
        self.live_bytes = sum(array.nbytes for layer in caches for array in layer)
        try:
            yield caches
        finally:
            self.live_bytes = 0
