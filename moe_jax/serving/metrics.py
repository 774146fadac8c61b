"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own.

Request counts and token totals are counted where requests end; queue depth, running batch, decode speed, anchor
cache and the backend's figures (host busy, device wait, bus bytes) are read from the engine thread's numbers when
scraped. The backend's figures are taken on the engine thread every few steps (taking them folds the host
engine's counters, which only that thread may do between steps).
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

RATE_WINDOW_S = 10.0  # tokens/s is measured over this much recent time
BACKEND_EVERY_STEPS = 16


class ServerMetrics:
    def __init__(self, service):
        self.service = service
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "moe_jax_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.finished = Counter(
            "moe_jax_generations_finished",
            "Generations ended, by reason (eos, stop, length, cancelled, error)",
            ["reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "moe_jax_prompt_tokens", "Prompt tokens of finished generations", registry=self.registry
        )
        self.cached_tokens = Counter(
            "moe_jax_cached_prompt_tokens",
            "Prompt tokens whose KV came from the anchor cache",
            registry=self.registry,
        )
        self.completion_tokens = Counter("moe_jax_completion_tokens", "Tokens generated", registry=self.registry)
        self.batch_size = Histogram(
            "moe_jax_decode_batch_size",
            "Sequences decoded together, per decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.registry.register(_LiveCollector(self))
        self._recent = collections.deque()  # (time, tokens decoded so far), for tokens/s
        self._backend = {"host_busy_s": 0.0, "device_wait_s": 0.0, "host_to_device": 0.0, "device_to_host": 0.0}
        self._busy_by_process: list[float] = []  # expert parallel: each process's host busy seconds
        self._lock = threading.Lock()
        service.scheduler.on_step = self.on_step
        service.on_finish = self.count_finish

    def on_step(self, rows: int):
        """Engine thread, after every decode step."""
        self.batch_size.observe(rows)
        scheduler = self.service.scheduler
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, scheduler.engine.stats.decode_tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
        if scheduler.stats.steps % BACKEND_EVERY_STEPS == 0:
            model = self.service.model
            m = model.metrics()
            leader = model.generation.leader  # the other processes' figures, from them
            busy = [m.host_busy_s] + ([other["host_busy_s"] for other in leader.metrics()] if leader else [])
            with self._lock:
                if len(busy) > 1:
                    totals = self._busy_by_process or [0.0] * len(busy)
                    self._busy_by_process = [t + b for t, b in zip(totals, busy, strict=True)]
                self._backend["host_busy_s"] += m.host_busy_s
                self._backend["device_wait_s"] += m.device_wait_s
                self._backend["host_to_device"] += m.host_to_device_bytes
                self._backend["device_to_host"] += m.device_to_host_bytes

    def tokens_per_second(self) -> float:
        with self._lock:
            if len(self._recent) < 2:
                return 0.0
            (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
        idle = time.monotonic() - t1
        return (n1 - n0) / (t1 - t0 + idle) if t1 > t0 else 0.0

    def backend_totals(self) -> dict:
        with self._lock:
            return dict(self._backend)

    def busy_by_process(self) -> list[float]:
        """Each process's host busy seconds (expert parallel; empty for one process)."""
        with self._lock:
            return list(self._busy_by_process)

    def count_finish(self, completion):
        """Engine thread, when a generation ends."""
        self.finished.labels(completion.finish_reason).inc()
        self.prompt_tokens.inc(completion.prompt_tokens)
        self.cached_tokens.inc(completion.reused_tokens)
        self.completion_tokens.inc(len(completion.tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Figures read at scrape time from the engine thread's numbers."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        service = self.metrics.service
        stats = service.scheduler.stats
        yield GaugeMetricFamily("moe_jax_queue_depth", "Requests waiting for a slot", value=stats.waiting)
        yield GaugeMetricFamily("moe_jax_running_batch_size", "Sequences in the running batch", value=stats.running)
        yield GaugeMetricFamily(
            "moe_jax_decode_tokens_per_second",
            f"Tokens decoded per second over the last {RATE_WINDOW_S:.0f} s",
            value=self.metrics.tokens_per_second(),
        )
        yield CounterMetricFamily("moe_jax_decode_steps", "Decode steps run", value=stats.steps)
        engine = service.scheduler.engine.stats
        yield CounterMetricFamily(
            "moe_jax_draft_tokens", "Prompt-lookup drafts verified by speculative steps", value=engine.drafted_tokens
        )
        yield CounterMetricFamily(
            "moe_jax_accepted_draft_tokens",
            "Verified drafts accepted (the model's own tokens)",
            value=engine.accepted_tokens,
        )
        yield CounterMetricFamily(
            "moe_jax_step_failures", "Steps that failed (their requests got errors)", value=stats.failures
        )
        backend = self.metrics.backend_totals()
        yield CounterMetricFamily(
            "moe_jax_host_busy_seconds", "Host expert threads' busy time", value=backend["host_busy_s"]
        )
        by_process = self.metrics.busy_by_process()
        if by_process:
            busy = CounterMetricFamily(
                "moe_jax_process_host_busy_seconds",
                "Each process's host expert threads' busy time (expert parallel; its rate: the busy share)",
                labels=["process"],
            )
            for index, seconds in enumerate(by_process):
                busy.add_metric([str(index)], seconds)
            yield busy
        yield CounterMetricFamily(
            "moe_jax_device_wait_seconds", "Device time spent waiting for host results", value=backend["device_wait_s"]
        )
        bus = CounterMetricFamily("moe_jax_bus_bytes", "Bytes across the host-device bus", labels=["direction"])
        bus.add_metric(["host_to_device"], backend["host_to_device"])
        bus.add_metric(["device_to_host"], backend["device_to_host"])
        yield bus
        cache = service.anchor_cache
        if cache is not None:
            summary = cache.summary()
            yield CounterMetricFamily(
                "moe_jax_anchor_cache_hits", "Prompts that reused a cached prefix", value=summary["hits"]
            )
            yield CounterMetricFamily(
                "moe_jax_anchor_cache_reused_tokens", "Prompt tokens not prefilled", value=summary["reused_tokens"]
            )
            yield GaugeMetricFamily(
                "moe_jax_anchor_cache_bytes", "Bytes the anchor cache holds", value=summary["bytes_held"]
            )
