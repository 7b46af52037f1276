"""Prometheus metrics at /metrics (prometheus-client; names after vLLM's where they match):
requests waiting and running, prompt and generated tokens, time to first token and inter-token
latency histograms, KV-cache use and the prefix-cache hit rate. Gauges are read from the engine
when scraped; counters and histograms are updated as requests run. Each app has its own
registry, so several servers in one process (the tests) do not share counts."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0)  # fmt: skip


class ServerMetrics:
    """The metrics of one server over one Engine."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        Gauge("lmforge_requests_running", "sequences in the running batch", registry=r,
              ).set_function(lambda: len(engine.rows))  # fmt: skip
        Gauge("lmforge_requests_waiting", "sequences waiting for a batch slot", registry=r,
              ).set_function(lambda: len(engine.waiting))  # fmt: skip
        Gauge("lmforge_kv_cache_usage_ratio", "share of the KV cache's token slots in use",
              registry=r).set_function(self.kv_cache_usage)  # fmt: skip
        Gauge(
            "lmforge_prefix_cache_hit_rate",
            "share of prompt tokens found in the prefix cache (0 when it is off)",
            registry=r,
        ).set_function(self.prefix_hit_rate)
        counter = functools.partial(Counter, registry=r)
        histogram = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = counter("lmforge_prompt_tokens", "prompt tokens received")
        self.generation_tokens = counter("lmforge_generation_tokens", "tokens generated")
        self.requests = counter("lmforge_requests", "requests finished", ["endpoint"])
        self.ttft = histogram("lmforge_time_to_first_token_seconds", "time to first token")
        self.itl = histogram("lmforge_inter_token_latency_seconds", "time between tokens")

    def kv_cache_usage(self) -> float:
        engine = self.engine
        used = sum(len(s.prompt) + len(s.output) for s in list(engine.rows))
        return used / (engine.max_batch * engine.max_len)

    def prefix_hit_rate(self) -> float:
        stats = getattr(self.engine, "prefix_cache_stats", None)
        if stats is None or not stats.queried:
            return 0.0
        return stats.hit / stats.queried

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def metered(self, outputs: AsyncIterator[list], prompt_tokens: int, endpoint: str):
        """`outputs` passed through, timing the first token and the gaps between tokens."""
        self.prompt_tokens.inc(prompt_tokens)
        start = last = time.perf_counter()
        first = True
        try:
            async for outs in outputs:
                now = time.perf_counter()
                made = sum(len(o.token_ids) for o in outs)
                if made:
                    self.generation_tokens.inc(made)
                    if first:
                        self.ttft.observe(now - start)
                        first, made = False, made - 1
                    for _ in range(made):  # tokens that arrived together share the gap
                        self.itl.observe((now - last) / made)
                    last = now
                yield outs
            self.requests.labels(endpoint).inc()
        finally:  # closed early (a client gone): close the request's own stream now, which
            await outputs.aclose()  # aborts it and frees its batch slot
