"""The decode worker's Prometheus metrics: admission, the running batch, its KV pool and the KV it receives."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.engine_core import EngineStats
from pdserve.metric_families import EngineCounters, LatencyMetrics, TransferMetrics, request_counter
from pdserve.metrics_server import BATCH_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

# prompt tokens whose KV the prefix cache held, neither computed here (local prefill, recompute) nor received (a
# prompt's blocks that landed for an earlier request, such as another choice of it)
DECODE_COUNTERS = (
    (
        "prefix_cache_hit_tokens",
        "Prompt tokens whose KV the prefix cache held: not computed here, not received from a prefill worker.",
        lambda s: s.prefix_hit_tokens,
    ),
    (
        "speculative_draft_proposed_tokens",
        "Guessed tokens checked that the draft model guessed (--speculative-draft; the rest are prompt lookup's).",
        lambda s: s.speculative_drafted_total,
    ),
    (
        "speculative_draft_accepted_tokens",
        "Of the draft model's guessed tokens, those kept.",
        lambda s: s.speculative_draft_accepted_total,
    ),
)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = request_counter("decode", "Finished Decode requests by outcome.", r)
        self.queue_time = Histogram(
            "pdserve_decode_queue_time_seconds",
            "Arrival until KV blocks were reserved.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.latency = LatencyMetrics(
            "decode",
            (
                "Arrival until the first token (prefill + KV transfer) was streamed.",
                "Gap between a sequence's tokens.",
                "Arrival until the last token.",
            ),
            r,
        )
        self.step_time = Histogram(
            "pdserve_decode_step_seconds", "One continuous-batching forward + sample.", buckets=ITL_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "pdserve_decode_batch_size", "Sequences per decode step.", buckets=BATCH_BUCKETS, registry=r
        )
        self.generation_tokens = Counter("pdserve_decode_generation_tokens", "Tokens generated.", registry=r)
        self.preemptions = Counter("pdserve_decode_preemptions", "Sequences preempted and recomputed.", registry=r)
        self.speculative_proposed = Counter(
            "pdserve_decode_speculative_proposed_tokens",
            "Tokens guessed by prompt lookup and checked (counted when their request ends).",
            registry=r,
        )
        self.speculative_accepted = Counter(
            "pdserve_decode_speculative_accepted_tokens",
            "Guessed tokens the model's own choice confirmed (counted when their request ends).",
            registry=r,
        )
        self.speculative_acceptance = Histogram(
            "pdserve_decode_speculative_acceptance_ratio",
            "Per request that speculated: accepted over proposed guesses.",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.transfer = TransferMetrics(sent=False, registry=r)
        self.engine_counters = EngineCounters("decode", r, DECODE_COUNTERS)
        self.running = Gauge("pdserve_decode_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("pdserve_decode_requests_waiting", "Requests waiting for blocks or prefill.", registry=r)
        self.kv_blocks = Gauge("pdserve_decode_kv_blocks", "KV blocks by state.", ["state"], registry=r)
        self.kv_usage = Gauge("pdserve_decode_kv_cache_usage_ratio", "Used KV blocks over all blocks.", registry=r)

    def bind_state(self, stats: Callable[[], EngineStats]) -> None:
        """Read gauges from the engine's stats at scrape time, so the hot path never updates them."""
        self.running.set_function(lambda: stats().running)
        self.waiting.set_function(lambda: (s := stats()).waiting + s.reserving + s.awaiting_kv)
        self.kv_blocks.labels("used").set_function(lambda: stats().kv_blocks_used)
        self.kv_blocks.labels("free").set_function(lambda: (s := stats()).kv_blocks_total - s.kv_blocks_used)
        self.kv_usage.set_function(lambda: (s := stats()).kv_blocks_used / s.kv_blocks_total)
        self.engine_counters.bind(stats)
