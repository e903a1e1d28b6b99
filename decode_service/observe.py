"""What a decode worker tells the outside about its requests: spans, Prometheus metrics, the request log line.

The worker calls these hooks at the points of a request's life (admitted, first token, tokens, end) and of its
loop (a step, a landed transfer); everything observability needs to remember lives here, not in the worker.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.decode_service.metrics import DecodeMetrics
from pdserve.engine.grammar import constraint_attributes
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.failures import outcome
from pdserve.kvtransfer.stats import TransferStats
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import extract, trace_id

request_log = logging.getLogger(REQUEST_LOGGER)


class RequestWatch:
    """One request's spans, timings and log line."""

    def __init__(self, observer: DecodeObserver, seq: Sequence, prefill: str) -> None:
        self.observer = observer
        self.seq = seq
        self.prefill = prefill or "local"
        self.context = otel_context.get_current()
        self.trace_id = trace_id()
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self.last = 0.0
        self._stream: trace.Span | None = None

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Around reserving the request's blocks (waiting for them included)."""
        with self.observer.tracer.start_as_current_span("decode.admit") as span:
            span.set_attributes(
                {
                    "pdserve.request_id": self.seq.request_id,
                    "pdserve.prompt_tokens": self.seq.num_prompt_tokens,
                    "pdserve.prefill": self.prefill,
                    **constraint_attributes(self.seq.params.constraint),
                }
            )
            yield
            if self.seq.block_ids:
                span.set_attribute("pdserve.blocks", len(self.seq.block_ids))
        self.observer.metrics.queue_time.observe(time.perf_counter() - self.t0)

    def first_token(self) -> contextlib.AbstractContextManager:
        """Around computing the first token (here, or by a prefill worker whose call is traced inside it)."""
        return self.observer.tracer.start_as_current_span(
            "decode.first_token", attributes={"pdserve.prefill": self.prefill}
        )

    def tokens(self, n: int) -> None:
        """`n` tokens are about to be streamed in one message."""
        m = self.observer.metrics
        now = time.perf_counter() - self.t0
        if self.ttft is None:
            self.ttft = now
            m.latency.ttft.observe(now)
            self._stream = self.observer.tracer.start_span("decode.stream", context=self.context)
        else:
            m.latency.itl.observe(now - self.last)
            for _ in range(n - 1):
                m.latency.itl.observe(0.0)
        self.last = now
        m.generation_tokens.inc(n)

    def end(self, error: BaseException | None, deadline: float | None) -> None:
        m, seq = self.observer.metrics, self.seq
        status = outcome(error, deadline)
        e2e = time.perf_counter() - self.t0
        if status == "ok":
            m.latency.e2e.observe(e2e)
        m.requests.labels(status).inc()
        spec = seq.speculation
        proposed, accepted = (spec.proposed, spec.accepted) if spec is not None else (0, 0)
        if proposed:
            m.speculative_proposed.inc(proposed)
            m.speculative_accepted.inc(accepted)
            m.speculative_acceptance.observe(accepted / proposed)
        if self._stream is not None:
            self._stream.set_attributes(
                {
                    "pdserve.completion_tokens": seq.num_output_tokens,
                    "pdserve.finish_reason": seq.finish_reason or status,
                    **(
                        {
                            "pdserve.speculative.proposed": proposed,
                            "pdserve.speculative.accepted": accepted,
                            "pdserve.speculative.drafted": spec.model.proposed,
                            "pdserve.speculative.draft_accepted": spec.model.accepted,
                        }
                        if spec is not None
                        else {}
                    ),
                }
            )
            self._stream.end()
        log_request(
            request_log,
            request_id=seq.request_id,
            trace_id=self.trace_id,
            status=status,
            finish_reason=seq.finish_reason or "",
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            ttft_s=round(self.ttft, 4) if self.ttft is not None else None,
            e2e_s=round(e2e, 4),
            prefill=self.prefill,
            **({"speculative_proposed": proposed, "speculative_accepted": accepted} if spec is not None else {}),
        )


class DecodeObserver:
    def __init__(self, tracer: trace.Tracer | None = None, metrics: DecodeMetrics | None = None) -> None:
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or DecodeMetrics()

    def request(self, seq: Sequence, prefill: str) -> RequestWatch:
        """Start watching a request (call it in the request's own trace context)."""
        return RequestWatch(self, seq, prefill)

    def step(self, batch: ScheduledBatch, seconds: float) -> None:
        self.metrics.step_time.observe(seconds)
        self.metrics.batch_size.observe(len(batch.seqs))
        if batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))

    def transferred(self, stats: TransferStats) -> None:
        """Count a landed transfer and record it as a span under the sender's `kv.transfer` span."""
        self.metrics.transfer.record(stats)
        start = int(stats.started_at * 1e9)
        span = self.tracer.start_span(
            "kv.receive",
            context=extract(stats.trace),
            kind=trace.SpanKind.CONSUMER,
            start_time=start,
            attributes={
                "pdserve.request_id": stats.request_id,
                "kv.bytes": stats.nbytes,
                "kv.layers": stats.layers,
                "kv.blocks": stats.blocks,
                "kv.gbps": stats.gbps,
                "kv.seconds": stats.seconds,
                "kv.tail_seconds": stats.tail_seconds,
                "kv.transport": stats.transport,
                "kv.path": stats.path,
            },
        )
        span.end(end_time=start + int(stats.seconds * 1e9))
