"""What the gateway tells the outside about each request: its server span's attributes, Prometheus metrics and the
structured request log line. The request path reports what happened (tokens sent, the workers chosen, how it
ended) to a `RequestWatch`; the figures are kept and written here."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from opentelemetry import trace

from pdserve.deadline import deadline_passed
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import extract, trace_id

request_log = logging.getLogger(REQUEST_LOGGER)


def http_span(tracer: trace.Tracer, request: Request, route: str) -> trace.Span:
    """The server span of one OpenAI API request, continuing the caller's trace, with the HTTP semantic conventions'
    attributes (what trace backends filter and group by)."""
    return tracer.start_span(
        f"POST {route}",
        kind=trace.SpanKind.SERVER,
        context=extract(dict(request.headers)),
        attributes={
            "http.request.method": "POST",
            "http.route": route,
            "url.path": request.url.path,
            "url.scheme": request.url.scheme,
            "network.protocol.version": request.scope.get("http_version", "1.1"),
            "user_agent.original": request.headers.get("user-agent", ""),
        },
    )


def http_span_answered(span: trace.Span, response: Response | None) -> None:
    """The response's status on the span; the span ends here unless a stream goes on (it ends the span itself)."""
    if response is not None:
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 400:
            span.set_attribute("error.type", str(response.status_code))
    if not isinstance(response, StreamingResponse):
        span.end()


class RequestWatch:
    """One request, from arrival to its end; `end` is called once."""

    def __init__(self, metrics: GatewayMetrics, model: str, request_id: str, front: str) -> None:
        self.metrics = metrics
        self.model = model
        self.request_id = request_id
        self.front = front
        self.span = trace.get_current_span()  # the front door's server span (non-recording when tracing is off)
        self.span.set_attributes({"pdserve.request_id": request_id, "pdserve.model": model, "pdserve.front": front})
        self.start = time.perf_counter()
        self.status = "OK"
        self.finish_reason = ""
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.ttft: float | None = None
        self.last_token = 0.0
        self.decode = ""
        self.prefill = ""
        self.migrations = 0
        self._moved = False
        metrics.in_flight.inc()

    def routed(self, decode: str, prefill: str) -> None:
        self.decode, self.prefill = decode, prefill
        self.metrics.prefill_routes.labels("remote" if prefill else "local").inc()

    def token_sent(self, completion_tokens: int, cached_tokens: int) -> None:
        """A message with tokens went to the client; the counts are the request's totals so far."""
        self.completion_tokens, self.cached_tokens = completion_tokens, cached_tokens
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
            self.metrics.latency.ttft.observe(self.ttft)
        else:
            self.metrics.latency.itl.observe(now - self.last_token)
            if self._moved:  # the client's gap across a migration: last token before it to first after
                self.metrics.migration_stall.observe(now - self.last_token)
        self._moved = False
        self.last_token = now

    def migrated(self, reason: str, source: str, target: str, generated: int, reprefill: int) -> None:
        """The stream broke after `generated` tokens on `source`; `target` continues it from `reprefill` tokens."""
        self.migrations += 1
        self._moved = True
        self.metrics.migrations.labels(reason).inc()
        self.metrics.migration_tokens.inc(reprefill)
        self.span.add_event(
            "pdserve.migrated",
            {
                "pdserve.from": source,
                "pdserve.to": target,
                "pdserve.reason": reason,
                "pdserve.generated_tokens": generated,
                "pdserve.reprefill_tokens": reprefill,
            },
        )

    def retried(self) -> None:
        self.metrics.retries.inc()

    def failed(self, error: BaseException, status: str | None, deadline: float | None) -> None:
        """It ended with `error`: `status` is the gRPC status name it is reported with (None: a cancellation or
        an unexpected failure, told apart here)."""
        if status is not None:
            self.status = status
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            self.status = "DEADLINE_EXCEEDED" if deadline_passed(deadline) else "CANCELLED"
        else:
            self.status = "INTERNAL"

    def end(self) -> None:
        m = self.metrics
        m.in_flight.dec()
        e2e = time.perf_counter() - self.start
        m.requests.labels(self.status, self.finish_reason).inc()
        if self.status == "OK":
            m.latency.e2e.observe(e2e)
            m.prompt_tokens.inc(self.prompt_tokens)
            m.cached_prompt_tokens.inc(self.cached_tokens)
            m.prompt_len.observe(self.prompt_tokens)
        m.generation_tokens.inc(self.completion_tokens)
        self.span.set_attributes(
            {
                "pdserve.prompt_tokens": self.prompt_tokens,
                "pdserve.completion_tokens": self.completion_tokens,
                "pdserve.cached_prompt_tokens": self.cached_tokens,
                "pdserve.finish_reason": self.finish_reason,
                "pdserve.status": self.status,
                "pdserve.migrations": self.migrations,
            }
        )
        log_request(
            request_log,
            request_id=self.request_id,
            trace_id=trace_id(self.span),
            model=self.model,
            front=self.front,
            status=self.status,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            ttft_s=round(self.ttft, 4) if self.ttft is not None else None,
            e2e_s=round(e2e, 4),
            decode=self.decode,
            prefill=self.prefill,
            migrations=self.migrations,
        )
