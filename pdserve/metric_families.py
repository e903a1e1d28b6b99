"""The metrics more than one service declares, declared once: request latency as a client sees it (the gateway and
the decode workers), KV transfers (sent by prefill workers, received by decode workers), finished requests by
their failure-table label, and the counters both workers' engines keep (the grammar compiler's). Each service
keeps its own names, so dashboards and queries stay as they are."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.failures import OK
from pdserve.kvtransfer.stats import TransferStats
from pdserve.metrics_server import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

if TYPE_CHECKING:  # the gateway imports this module and must not import the engine (torch)
    from pdserve.engine.engine_core import EngineStats


class LatencyMetrics:
    """TTFT, inter-token latency and end-to-end latency of `pdserve_<service>_...`; `what` says where they are
    measured from and to (help texts)."""

    def __init__(self, service: str, what: tuple[str, str, str], registry: CollectorRegistry) -> None:
        prefix = f"pdserve_{service}"
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", what[0], buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(f"{prefix}_inter_token_latency_seconds", what[1], buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{prefix}_e2e_request_latency_seconds", what[2], buckets=E2E_BUCKETS, registry=registry)


class TransferMetrics:
    """One side of the KV plane: bytes, seconds, the tail a transfer adds to TTFT, and transfers by path."""

    def __init__(self, sent: bool, registry: CollectorRegistry) -> None:
        r = registry
        if sent:
            self.bytes = Counter("pdserve_kv_transfer_sent_bytes", "KV bytes sent to decode workers.", registry=r)
            seconds, tail, count = "pdserve_kv_transfer_seconds", "pdserve_kv_transfer_tail_seconds", "sent"
            spans = ("Begin of a request's KV transfer until the decode worker acknowledged it.",
                     "Last layer queued until the decode worker acknowledged the transfer: what it adds to TTFT.",
                     "Acknowledged KV transfers")  # fmt: skip
        else:
            self.bytes = Counter("pdserve_kv_transfer_received_bytes", "KV bytes received from prefill.", registry=r)
            seconds, tail = "pdserve_kv_transfer_receive_seconds", "pdserve_kv_transfer_receive_tail_seconds"
            count = "received"
            spans = ("First to last KV byte of one request.",
                     "Last layer announced until it landed: what the transfer adds to TTFT.",
                     "Landed KV transfers")  # fmt: skip
        self.seconds = Histogram(seconds, spans[0], buckets=TTFT_BUCKETS, registry=r)
        self.tail_seconds = Histogram(tail, spans[1], buckets=TTFT_BUCKETS, registry=r)
        self.transfers = Counter(
            f"pdserve_kv_transfers_{count}",
            f"{spans[2]}, by the path their blocks took (one-sided, staged, tcp).",
            ["path"],
            registry=r,
        )

    def record(self, stats: TransferStats) -> None:
        self.bytes.inc(stats.nbytes)
        self.seconds.observe(stats.seconds)
        self.tail_seconds.observe(stats.tail_seconds)
        self.transfers.labels(stats.path).inc()


def request_counter(service: str, what: str, registry: CollectorRegistry) -> Counter:
    """`pdserve_<service>_requests{status}`: finished requests by their failure-table label (`ok` when they
    finished), present at zero from the start so rates begin there."""
    counter = Counter(f"pdserve_{service}_requests", what, ["status"], registry=registry)
    counter.labels(OK)
    return counter


StatsReader = Callable[["EngineStats"], float]
GRAMMAR_COUNTERS: tuple[tuple[str, str, StatsReader], ...] = (
    (
        "grammar_compiles",
        "Constraints (JSON schemas, regexes, grammars) compiled: not among the recently compiled.",
        lambda s: s.grammar_compiles_total,
    ),
    (
        "grammar_cache_hits",
        "Constrained requests that started from a recently compiled constraint (a copy, no compile).",
        lambda s: s.grammar_cache_hits_total,
    ),
    (
        "grammar_compile_seconds",
        "Seconds spent compiling constraints (off the model thread).",
        lambda s: s.grammar_compile_seconds_total,
    ),
)


class EngineCounters(Collector):
    """`pdserve_<service>_<name>` counters the engine keeps, read from its stats at scrape time (nothing on the
    request path updates them): the grammar compiler's, which both workers run, and any `extra` a service adds
    (name, help, reader)."""

    def __init__(
        self, service: str, registry: CollectorRegistry, extra: tuple[tuple[str, str, StatsReader], ...] = ()
    ) -> None:
        self._prefix = f"pdserve_{service}"
        self._counters = (*GRAMMAR_COUNTERS, *extra)
        self._stats: Callable[[], EngineStats] | None = None
        registry.register(self)

    def bind(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self._stats() if self._stats is not None else None
        for name, what, read in self._counters:
            yield CounterMetricFamily(f"{self._prefix}_{name}", what, value=read(s) if s is not None else 0)
