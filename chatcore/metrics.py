"""Prometheus metrics. One registry per server instance, so tests can run several.

Prefix-cache counters count tokens, never requests: each request adds its prompt tokens
to the queries, and the prompt tokens served from each tier to the hits.

The gauges that cost work to read (KV blocks by state, sessions by state) are set in the
background (`chatcore.server.ops_routes.GaugeRefresher`), never by a scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prefix_queries = Counter("chatcore_prefix_cache_queries_tokens_total",
                                      "Prompt tokens looked up in the prefix cache", ["tier"], registry=r)
        self.prefix_hits = Counter("chatcore_prefix_cache_hits_tokens_total",
                                   "Prompt tokens served from the prefix cache", ["tier"], registry=r)
        self.kv_blocks = Gauge("chatcore_kv_blocks", "KV blocks by state", ["state"], registry=r)
        self.sessions = Gauge("chatcore_sessions", "Sessions by state", ["state"], registry=r)
        self.preemptions = Counter("chatcore_preemptions_total", "Requests preempted (recompute)", registry=r)
        self.requests = Counter("chatcore_requests_total", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("chatcore_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("chatcore_inter_token_seconds", "Time between tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("chatcore_queue_seconds", "Time waiting before the first step",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.disk_blocks_rejected = Counter("chatcore_disk_blocks_rejected_total",
                                            "Disk-tier block files rejected (corrupt, truncated or foreign)",
                                            registry=r)
        for tier in ("device", "disk"):
            self.prefix_queries.labels(tier)
            self.prefix_hits.labels(tier)
        self._counted: dict[Counter, float] = {}

    def catch_up(self, counter: Counter, total: float) -> None:
        """Add to `counter` what a running `total` kept elsewhere (the scheduler's preemptions, the disk
        tier's rejections) gained since the last call."""
        seen = self._counted.get(counter, 0.0)
        if total > seen:
            counter.inc(total - seen)
            self._counted[counter] = total

    def set_kv_blocks(self, free: int, cached: int, used: int) -> None:
        self.kv_blocks.labels("free").set(free)
        self.kv_blocks.labels("cached").set(cached)
        self.kv_blocks.labels("used").set(used)

    def set_sessions(self, hot: int, warm: int, total: int) -> None:
        """`total`: every session in the database; those not live in this process are cold."""
        self.sessions.labels("hot").set(hot)
        self.sessions.labels("warm").set(warm)
        self.sessions.labels("cold").set(max(0, total - hot - warm))

    def record_request(self, finish_reason: str, prompt_tokens: int, device_hits: int, disk_hits: int,
                       queue_ms: float | None, ttft_ms: float | None, inter_token_ms: list[float]) -> None:
        self.requests.labels(finish_reason).inc()
        # Every prompt token is looked up on the device; those it missed are looked up on disk.
        self.prefix_queries.labels("device").inc(prompt_tokens)
        self.prefix_hits.labels("device").inc(device_hits)
        self.prefix_queries.labels("disk").inc(prompt_tokens - device_hits)
        self.prefix_hits.labels("disk").inc(disk_hits)
        if queue_ms is not None:
            self.queue.observe(queue_ms / 1000)
        if ttft_ms is not None:
            self.ttft.observe(ttft_ms / 1000)
        for gap in inter_token_ms:
            self.inter_token.observe(gap / 1000)
