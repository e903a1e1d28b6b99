"""OpenTelemetry tracing for one service: its TracerProvider, the gRPC interceptors, and context carriers.

Off (no endpoint) means no provider at all: the tracer is OpenTelemetry's no-op tracer, no interceptor is
installed and carriers are empty, so a request pays for a handful of no-op calls and nothing else. Each
service owns its `Tracing`; nothing is registered globally, so tests can run several in one process.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span

from pdserve.deadline import mark_ended_from_outside

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

GRPC_NOISE = ("grpc.health.v1.Health", "grpc.reflection.")


@dataclass
class TracingConfig:
    """Where spans go. `endpoint` None or empty turns tracing off."""

    endpoint: str | None = None
    protocol: str = "http/protobuf"  # or "grpc"
    sample_ratio: float = 1.0

    @classmethod
    def from_env(cls) -> TracingConfig:
        """The standard OTEL_* variables, so a deployment configures pdserve like any other OTel service."""
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
        )
        ratio = float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        return cls(endpoint or None, protocol, ratio)


class Tracing:
    """A service's tracer. `enabled` is False when the config has no endpoint (or no exporter is given)."""

    def __init__(
        self, service_name: str, config: TracingConfig | None = None, exporter=None, instance: str | None = None
    ) -> None:
        config = config or TracingConfig()
        self.service_name = service_name
        self._provider = None
        if exporter is None and config.endpoint:
            exporter = _otlp_exporter(config)
        if exporter is None:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        attrs = {"service.name": service_name}
        if instance:
            attrs["service.instance.id"] = instance
        self._provider = TracerProvider(
            resource=Resource.create(attrs), sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("pdserve")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def server_interceptors(self) -> list:
        if self._provider is None:
            return []
        return [_server_interceptor(self._provider)]

    def client_interceptors(self) -> list:
        if not self.enabled:
            return []
        from opentelemetry.instrumentation.grpc import aio_client_interceptors
        from opentelemetry.instrumentation.grpc._aio_client import UnaryStreamAioClientInterceptor

        interceptors = aio_client_interceptors(tracer_provider=self._provider, filter_=_not_noise())
        return [_cancel_aware(i) if isinstance(i, UnaryStreamAioClientInterceptor) else i for i in interceptors]

    def shutdown(self) -> None:
        """Flush what is buffered and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.tracer = trace.NoOpTracer()


def _cancel_aware(interceptor):
    """OpenTelemetry's streaming client interceptor, except that a call this side cancels (the caller went away,
    a deadline of ours) ends its span with CANCELLED, as the server's span says, instead of no status at all."""
    from opentelemetry.instrumentation.grpc._aio_client import UnaryStreamAioClientInterceptor

    class CancelAware(UnaryStreamAioClientInterceptor):
        async def _wrap_stream_response(self, span, call):
            try:
                async for response in call:
                    if self._response_hook:
                        self._call_response_hook(span, response)
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
                span.set_status(trace.Status(trace.StatusCode.ERROR, "CANCELLED: the caller cancelled the call"))
                raise
            except Exception as exc:
                self.add_error_details_to_span(span, exc)
                raise
            finally:
                span.end()

    return CancelAware(
        interceptor._tracer,
        filter_=interceptor._filter,
        request_hook=interceptor._request_hook,
        response_hook=interceptor._response_hook,
    )


def _server_interceptor(provider: TracerProvider):
    """OpenTelemetry's aio server interceptor, except that a call ended from outside (the client cancelled, its
    deadline passed) ends its span with CANCELLED or DEADLINE_EXCEEDED instead of OK. The end can reach a
    streaming handler two ways: as CancelledError inside it, or, when grpc was cancelled while writing a message,
    as the response generator being closed at a `yield`; both are caught here, while the span is still open, and
    the handler's own generator is closed inside the span too."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    from opentelemetry.instrumentation.grpc._aio_server import (
        OpenTelemetryAioServerInterceptor,
        _OpenTelemetryAioServicerContext,
    )

    class EndAware(OpenTelemetryAioServerInterceptor):
        def _intercept_aio_server_unary(self, behavior, handler_call_details):
            async def unary(request, context):
                with self._set_remote_context(context):
                    with self._start_span(handler_call_details, context, set_status_on_exception=False) as span:
                        context = _OpenTelemetryAioServicerContext(context, span)
                        try:
                            return await behavior(request, context)
                        except asyncio.CancelledError:
                            mark_ended_from_outside(context)
                            raise
                        except Exception as error:
                            if type(error) is not Exception:  # a bare Exception is grpc's abort, told by the context
                                span.record_exception(error)
                            raise

            return unary

        def _intercept_aio_server_stream(self, behavior, handler_call_details):
            async def stream(request, context):
                with self._set_remote_context(context):
                    with self._start_span(handler_call_details, context, set_status_on_exception=False) as span:
                        context = _OpenTelemetryAioServicerContext(context, span)
                        responses = behavior(request, context)
                        try:
                            async for response in responses:
                                yield response
                        except (asyncio.CancelledError, GeneratorExit):
                            mark_ended_from_outside(context)
                            raise
                        except Exception as error:
                            if type(error) is not Exception:
                                span.record_exception(error)
                            raise
                        finally:
                            await responses.aclose()

            return stream

    stock = aio_server_interceptor(tracer_provider=provider, filter_=_not_noise())  # its tracer, as it names it
    return EndAware(stock._tracer, filter_=stock._filter)


def _not_noise():
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(
        filters.any_of(*(filters.service_prefix(p) for p in GRPC_NOISE), filters.method_name("GetStats"))
    )


def _otlp_exporter(config: TracingConfig):
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.endpoint, insecure=True)
    if config.protocol not in ("http/protobuf", "http"):
        raise ValueError(f"OTLP protocol {config.protocol!r}: use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = (config.endpoint or "").rstrip("/")
    if not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    return HttpExporter(endpoint=endpoint)


def inject(span: Span | None = None) -> dict[str, str]:
    """W3C trace context of `span` (or the current span) as a dict; empty when nothing is being recorded."""
    ctx = trace.set_span_in_context(span) if span is not None else otel_context.get_current()
    if not trace.get_current_span(ctx).is_recording():
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: dict[str, str] | None) -> otel_context.Context | None:
    """The context a carrier from `inject` describes (None for an empty carrier)."""
    return propagate.extract(carrier) if carrier else None


def trace_id(span: Span | None = None) -> str:
    """Hex trace id of `span` (or the current span), '' when there is none."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
