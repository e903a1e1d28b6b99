"""The prefill worker's Prometheus metrics: queueing, batches, its prefix cache and the KV it ships."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.engine_core import EngineStats
from pdserve.metric_families import EngineCounters, TransferMetrics, request_counter
from pdserve.metrics_server import TOKEN_BUCKETS, TTFT_BUCKETS


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = request_counter("prefill", "Finished Prefill requests by outcome.", r)
        self.queue_time = Histogram(
            "pdserve_prefill_queue_time_seconds",
            "Arrival until the first forward step.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.forward_time = Histogram(
            "pdserve_prefill_forward_seconds",
            "First to last forward step of one prompt.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "pdserve_prefill_step_seconds", "One batched prefill forward.", buckets=TTFT_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "pdserve_prefill_batch_tokens", "Tokens computed per forward step.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("pdserve_prefill_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.prefix_hit_tokens = Counter(
            "pdserve_prefill_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.transfer = TransferMetrics(sent=True, registry=r)
        self.engine_counters = EngineCounters("prefill", r)
        self.running = Gauge("pdserve_prefill_requests_running", "Prompts being computed or transferred.", registry=r)
        self.waiting = Gauge("pdserve_prefill_requests_waiting", "Prompts queued.", registry=r)
        self.kv_blocks = Gauge("pdserve_prefill_kv_blocks", "KV blocks by state.", ["state"], registry=r)
        self.queued_tokens = Gauge(
            "pdserve_prefill_queued_tokens",
            "Prompt tokens still to compute (queued or part-way): the load signal prefill autoscaling follows.",
            registry=r,
        )

    def bind_state(self, running: Callable[[], int], stats: Callable[[], EngineStats]) -> None:
        """Read gauges from the worker and its engine's stats at scrape time, so the hot path never updates them."""
        self.running.set_function(running)
        self.waiting.set_function(lambda: stats().waiting)
        self.queued_tokens.set_function(lambda: (s := stats()).queued_tokens + s.prefilling_tokens)
        self.kv_blocks.labels("used").set_function(lambda: stats().kv_blocks_used)
        self.kv_blocks.labels("cached").set_function(lambda: stats().kv_blocks_evictable)
        self.kv_blocks.labels("free").set_function(
            lambda: (s := stats()).kv_blocks_total - s.kv_blocks_used - s.kv_blocks_evictable
        )
        self.engine_counters.bind(stats)
