"""The gateway's Prometheus metrics: what a client sees (TTFT, inter-token latency, end-to-end, status)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from pdserve.metric_families import LatencyMetrics
from pdserve.metrics_server import TOKEN_BUCKETS, TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_gateway_requests",
            "Finished Generate requests by final gRPC status and finish reason.",
            ["status", "finish_reason"],
            registry=r,
        )
        for reason in ("stop", "length"):  # present from the start, so rates and dashboards begin at zero
            self.requests.labels("OK", reason)
        self.in_flight = Gauge("pdserve_gateway_requests_in_flight", "Generate requests being served.", registry=r)
        self.latency = LatencyMetrics(
            "gateway",
            (
                "Request arrival to first token sent.",
                "Gap between consecutive tokens sent.",
                "Request arrival to last token sent.",
            ),
            r,
        )
        self.prompt_tokens = Counter("pdserve_gateway_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_prompt_tokens = Counter(
            "pdserve_gateway_cached_prompt_tokens",
            "Prompt tokens served from a prefill worker's prefix cache.",
            registry=r,
        )
        self.generation_tokens = Counter("pdserve_gateway_generation_tokens", "Tokens generated.", registry=r)
        self.prompt_len = Histogram(
            "pdserve_gateway_request_prompt_tokens", "Prompt length per request.", buckets=TOKEN_BUCKETS, registry=r
        )
        self._routing(r)

    def _routing(self, r: CollectorRegistry) -> None:
        """Where requests went: retries, migrations, workers by health, local and remote prefills."""
        self.retries = Counter(
            "pdserve_gateway_retries", "Requests re-routed after a worker refused or failed.", registry=r
        )
        self.migrations = Counter(
            "pdserve_gateway_migrations",
            "Streams moved to another decode worker after their first token, by why the stream broke.",
            ["reason"],
            registry=r,
        )
        self.migration_tokens = Counter(
            "pdserve_gateway_migration_prefill_tokens",
            "Tokens (prompt plus those generated so far) prefilled again because a stream moved.",
            registry=r,
        )
        self.migration_stall = Histogram(
            "pdserve_gateway_migration_stall_seconds",
            "What a moved stream's client waited: its last token before the move to its first after.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.workers = Gauge(
            "pdserve_gateway_workers", "Workers the router knows, by role and health.", ["role", "state"], registry=r
        )
        self.prefill_routes = Counter(
            "pdserve_gateway_prefill_routes",
            "Requests by where their prompt was prefilled: a prefill worker (remote) or the decode worker (local).",
            ["mode"],
            registry=r,
        )
        for mode in ("local", "remote"):
            self.prefill_routes.labels(mode)

    def bind_router(
        self, counts: Callable[[], dict[tuple[str, str], int]], indexed: Callable[[], dict[str, int]]
    ) -> None:
        """Read the router's view of its workers at scrape time: how many of each role are up, and how many
        prefix-cache blocks it believes each prefill worker holds."""

        def reader(key: tuple[str, str]) -> Callable[[], int]:
            return lambda: counts()[key]

        for role in ("prefill", "decode"):
            for state in ("healthy", "down"):
                self.workers.labels(role, state).set_function(reader((role, state)))
        self.registry.register(_IndexCollector(indexed))


class _IndexCollector:
    """`pdserve_gateway_prefix_index_blocks{worker}`: labels follow the workers the router knows right now."""

    def __init__(self, indexed: Callable[[], dict[str, int]]) -> None:
        self.indexed = indexed

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pdserve_gateway_prefix_index_blocks",
            "Prefix-cache blocks the KV-aware router believes each prefill worker holds.",
            labels=["worker"],
        )
        for worker, blocks in sorted(self.indexed().items()):
            family.add_metric([worker], blocks)
        yield family
