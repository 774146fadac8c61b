"""auto: checking the cost model's verdict on the real layer before trusting it.

How it works and why: docs/INTERNALS.md, moe_jax/backends/calibrate.py.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.backends.hybrid import HybridExperts, host_path, hybrid_experts
from moe_jax.planning.auto_choice import PHASES

REPEATS = 5  # timed calls of each path per phase, interleaved; medians compared


def host_faster_phases(layer: HybridExperts, dtype, seed: int = 0) -> tuple[frozenset[int], dict[int, tuple]]:
    """Phases whose calls the host path serves at least as fast as the device path, and (host, device) median
    seconds of one layer call for every phase measured."""
    spec = layer.spec
    store = spec.store
    rng = np.random.default_rng(seed)
    cache, streaming = layer.device_arrays()
    top_k = spec.shape.top_k

    def device_path(x, ids, weights):
        return hybrid_experts(spec, x, ids, weights, {}, cache, streaming)

    def host_only(x, ids, weights):
        return host_path(spec, x, ids, weights, {})

    host_faster, timings = set(), {}
    for tokens in PHASES:
        x = jnp.asarray(rng.standard_normal((tokens, store.hidden)) * 0.1, dtype)
        ids = np.stack([rng.choice(spec.num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
        weights = jnp.asarray(rng.dirichlet(np.ones(top_k), tokens), jnp.float32)
        paths = [jax.jit(device_path), jax.jit(host_only)]
        seconds = [[], []]
        for fn in paths:  # compile and warm up
            jax.block_until_ready(fn(x, jnp.asarray(ids), weights))
        for _ in range(REPEATS):
            for fn, times in zip(paths, seconds, strict=True):
                start = time.perf_counter()
                jax.block_until_ready(fn(x, jnp.asarray(ids), weights))
                times.append(time.perf_counter() - start)
        device_s, host_s = (float(np.median(t)) for t in seconds)
        timings[tokens] = (host_s, device_s)
        if host_s <= device_s:
            host_faster.add(tokens)
    spec.runtime.fold_host_metrics()  # calibration traffic: not routing the cache should learn from, nor metrics
    spec.runtime.routing.take()
    spec.runtime.metrics.take()
    return frozenset(host_faster), timings
