"""What a prefill worker tells the outside about its prompts: spans, Prometheus metrics, the request log line.

The worker calls these hooks when a prompt arrives, at each step of the engine loop, when a transfer begins and
ends, and when the request ends; the timings and spans they need live in a `JobWatch` per prompt.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.engine.grammar import constraint_attributes
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.failures import outcome
from pdserve.kvtransfer.stats import TransferStats
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.prefill_service.metrics import PrefillMetrics
from pdserve.tracing import inject, trace_id
from pdserve.wire import PrefillJob, PrefillResult

request_log = logging.getLogger(REQUEST_LOGGER)


class JobWatch:
    """One prompt's spans and timings."""

    def __init__(self, observer: PrefillObserver, job: PrefillJob) -> None:
        self.observer = observer
        self.job = job
        self.context = otel_context.get_current()
        self.trace_id = trace_id()
        self.t0 = time.perf_counter()
        self.arrived_ns = time.time_ns()  # wall clock, for spans recorded after the fact
        self.first_step_ns = 0
        self.steps = 0
        self._transfer: trace.Span | None = None

    def stepped(self, seq: Sequence, batch: ScheduledBatch, start_ns: int, end_ns: int, last: bool) -> None:
        """A step that held this prompt ran from start_ns to end_ns; `last`: it computed the prompt's last chunk."""
        m, tracer = self.observer.metrics, self.observer.tracer
        if self.steps == 0:
            self.first_step_ns = start_ns
            m.queue_time.observe((start_ns - self.arrived_ns) / 1e9)
            tracer.start_span("prefill.queue", context=self.context, start_time=self.arrived_ns).end(end_time=start_ns)
        self.steps += 1
        if not last:
            return
        m.forward_time.observe((end_ns - self.first_step_ns) / 1e9)
        m.prompt_tokens.inc(seq.num_prompt_tokens)
        m.prefix_hit_tokens.inc(seq.num_cached_tokens)
        tracer.start_span(
            "prefill.forward",
            context=self.context,
            start_time=self.first_step_ns,
            attributes={
                "pdserve.prompt_tokens": seq.num_prompt_tokens,
                "pdserve.cached_tokens": seq.num_cached_tokens,
                "pdserve.computed_tokens": len(seq.token_ids) - seq.num_cached_tokens,
                "pdserve.steps": self.steps,
                "pdserve.last_batch_tokens": batch.num_tokens,
                **constraint_attributes(seq.params.constraint),
            },
        ).end(end_time=end_ns)

    def sending(self, seq: Sequence, transport: str) -> dict[str, str]:
        """The transfer begins: opens its span and returns the trace context to send with it."""
        self._transfer = self.observer.tracer.start_span(
            "kv.transfer",
            context=self.context,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "pdserve.request_id": seq.request_id,
                "kv.destination": self.job.kv_address,
                "kv.transport": transport,
                "kv.blocks": len(seq.block_ids),
            },
        )
        return inject(self._transfer)

    def sent(self, stats: TransferStats | None = None, error: str | None = None) -> None:
        """The transfer ended (with its figures, or an error); safe to call more than once."""
        span, self._transfer = self._transfer, None
        if stats is not None:
            self.observer.metrics.transfer.record(stats)
        if span is None:
            return
        if stats is not None:
            span.set_attributes(
                {
                    "kv.bytes": stats.nbytes,
                    "kv.layers": stats.layers,
                    "kv.blocks": stats.blocks,
                    "kv.seconds": stats.seconds,
                    "kv.tail_seconds": stats.tail_seconds,
                    "kv.gbps": stats.gbps,
                    "kv.path": stats.path,
                }
            )
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end()

    def end(self, result: PrefillResult | None, error: BaseException | None) -> None:
        status = outcome(error)
        self.observer.metrics.requests.labels(status).inc()
        job = self.job
        fields: dict[str, object] = {"prompt_tokens": job.num_prompt_tokens, "tokens": len(job.token_ids)}
        if result is not None:
            fields.update(
                cached_tokens=result.cached_tokens,
                kv_bytes=result.transfer.get("bytes", 0),
                kv_gbps=round(result.transfer.get("gbps", 0.0), 3),
                kv_path=result.transfer.get("path", ""),
            )
        log_request(
            request_log,
            request_id=job.request_id,
            trace_id=self.trace_id,
            status=status,
            seconds=round(time.perf_counter() - self.t0, 4),
            decode_kv=job.kv_address,
            **fields,
        )


class PrefillObserver:
    def __init__(self, tracer: trace.Tracer | None = None, metrics: PrefillMetrics | None = None) -> None:
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or PrefillMetrics()

    def connecting(self, address: str) -> contextlib.AbstractContextManager:
        """Around opening the KV connection to a decode worker's receiver."""
        return self.tracer.start_as_current_span("kv.connect", attributes={"kv.destination": address})

    def job(self, job: PrefillJob) -> JobWatch:
        """Start watching a prompt (call it in the request's own trace context)."""
        return JobWatch(self, job)

    def step(self, batch: ScheduledBatch, seconds: float, watch_of: Callable[[Sequence], JobWatch | None]) -> None:
        """A step ended: its figures, and each prompt's queue wait at its first step and forward span at its last."""
        end_ns = time.time_ns()
        start_ns = end_ns - int(seconds * 1e9)
        self.metrics.step_time.observe(seconds)
        self.metrics.batch_tokens.observe(batch.num_tokens)
        for i, seq in enumerate(batch.seqs):
            watch = watch_of(seq)
            if watch is not None:
                watch.stepped(seq, batch, start_ns, end_ns, batch.samples(i))
