"""The public gRPC API: validates, tokenizes, routes to a decode worker (which pulls in a prefill worker), and
streams text back with stop strings applied."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry import trace

from gateway.metrics import GatewayMetrics
from gateway.router import NoWorkerAvailable, Router
from gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
from gateway.tokenizer import Tokenizer
from pdserve.grpc_server import RunningServer, start_server
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import Tracing, trace_id
from protos import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_STOP_STRINGS = 16


@dataclass
class _Outcome:
    """What one Generate request did, filled in as it goes; read once at the end."""

    request_id: str
    start: float
    status: str = "OK"
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    last_token: float = 0.0
    decode: str = ""
    prefill: str = ""

    def token_sent(self, metrics: GatewayMetrics) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
            metrics.ttft.observe(self.ttft)
        else:
            metrics.itl.observe(now - self.last_token)
        self.last_token = now


def _status_of(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code.name
    return "UNKNOWN"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, model_name: str, router: Router, max_attempts: int = 3,
                 tracer: trace.Tracer | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.router = router
        self.max_attempts = max_attempts
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or GatewayMetrics()

    async def _prompt_ids(self, request, context) -> list[int]:
        if request.model and request.model != self.model_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown model {request.model!r}; this gateway serves {self.model_name!r}")
        kind = request.WhichOneof("input")
        if kind == "prompt":
            ids = self.tokenizer.encode(request.prompt)
        elif kind == "chat":
            if not request.chat.messages:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chat has no messages")
            try:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in request.chat.messages])
            except Exception as e:  # noqa: BLE001 - template errors are the caller's input
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chat template failed: {e}")
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            ids = []
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        limit = self.router.max_model_len
        if limit and len(ids) >= limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {len(ids)} tokens; the model context is {limit}")
        return ids

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Stream one request, then count it, log it and close its span, however it ended."""
        out = _Outcome(request.request_id or uuid.uuid4().hex, time.perf_counter())
        span = trace.get_current_span()  # the gRPC server span (non-recording when tracing is off)
        span.set_attribute("pdserve.request_id", out.request_id)
        span.set_attribute("pdserve.model", self.model_name)
        self.metrics.in_flight.inc()
        try:
            async for resp in self._generate(request, context, out):
                yield resp
        except BaseException as e:
            out.status = _status_of(e, context)
            raise
        finally:
            self.metrics.in_flight.dec()
            self._record(out, span)

    async def _generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        out: "_Outcome"):
        rid = out.request_id
        with self.tracer.start_as_current_span("gateway.tokenize") as span:
            prompt_ids = await self._prompt_ids(request, context)
            span.set_attribute("pdserve.prompt_tokens", len(prompt_ids))
        out.prompt_tokens = len(prompt_ids)
        stops = list(request.sampling.stop)
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"stop must hold 1..{MAX_STOP_STRINGS} non-empty strings")
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        del sampling.stop[:]
        detok = IncrementalDetokenizer(self.tokenizer.hf)
        matcher = StopStringMatcher(stops)
        usage = common_pb2.Usage(prompt_tokens=len(prompt_ids))
        tried: set[str] = set()
        last_error: grpc.aio.AioRpcError | None = None
        for attempt in range(self.max_attempts):
            with self.tracer.start_as_current_span("gateway.route") as span:
                try:
                    decode, prefill = self.router.pick(tried)
                except NoWorkerAvailable as e:
                    if last_error is not None:  # every worker left was tried: report what the last one said
                        await context.abort(last_error.code(), last_error.details() or last_error.code().name)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                prefill_address = prefill.address if prefill else ""
                span.set_attributes({"pdserve.decode": decode.address, "pdserve.prefill": prefill_address,
                                     "pdserve.attempt": attempt})
            out.decode, out.prefill = decode.address, prefill_address
            decode.inflight += 1
            prefill_pending = prefill is not None
            if prefill_pending:
                prefill.inflight += 1
            call = decode.stub.Decode(
                worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                                         prefill_address=prefill_address),
                timeout=context.time_remaining())
            streamed = False
            try:
                async for resp in call:
                    if not streamed:
                        usage.cached_prompt_tokens = resp.cached_prompt_tokens
                    if prefill_pending:
                        prefill.inflight -= 1
                        prefill_pending = False
                    streamed = True
                    usage.completion_tokens += len(resp.token_ids)
                    text = matcher.feed(detok.add(resp.token_ids))
                    finish = resp.finish_reason
                    if matcher.stopped:
                        finish = common_pb2.FINISH_REASON_STOP
                    elif finish:
                        text += matcher.feed(detok.flush()) + matcher.flush()
                    msg = generation_pb2.GenerateResponse(request_id=rid, text=text, token_ids=resp.token_ids,
                                                          logprobs=resp.logprobs, finish_reason=finish)
                    out.cached_tokens, out.completion_tokens = usage.cached_prompt_tokens, usage.completion_tokens
                    if finish:
                        msg.usage.CopyFrom(usage)
                        out.finish_reason = common_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
                    out.token_sent(self.metrics)
                    yield msg
                    if finish:
                        if resp.finish_reason:
                            async for _ in call:  # the worker's stream ends here; reading its end closes the span
                                pass
                        return
                await context.abort(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if not streamed and code in RETRYABLE and attempt + 1 < self.max_attempts:
                    log.warning("request %s: %s via %s/%s (%s); retrying elsewhere", rid, code.name,
                                decode.address, prefill_address, e.details())
                    self.metrics.retries.inc()
                    if code == grpc.StatusCode.UNAVAILABLE:
                        culprit = (prefill_address if prefill_address and prefill_address in (e.details() or "")
                                   else decode.address)
                        self.router.mark_down(culprit)
                        tried.add(culprit)
                    else:
                        tried.add(decode.address)
                    last_error = e
                    continue
                await context.abort(code, e.details() or code.name)
            finally:
                call.cancel()
                decode.inflight -= 1
                if prefill_pending:
                    prefill.inflight -= 1

    def _record(self, out: "_Outcome", span: trace.Span) -> None:
        m = self.metrics
        e2e = time.perf_counter() - out.start
        m.requests.labels(out.status, out.finish_reason).inc()
        if out.status == "OK":
            m.e2e.observe(e2e)
            m.prompt_tokens.inc(out.prompt_tokens)
            m.cached_prompt_tokens.inc(out.cached_tokens)
            m.prompt_len.observe(out.prompt_tokens)
        m.generation_tokens.inc(out.completion_tokens)
        span.set_attributes({"pdserve.prompt_tokens": out.prompt_tokens,
                             "pdserve.completion_tokens": out.completion_tokens,
                             "pdserve.cached_prompt_tokens": out.cached_tokens,
                             "pdserve.finish_reason": out.finish_reason, "pdserve.status": out.status})
        log_request(request_log, request_id=out.request_id, trace_id=trace_id(span), model=self.model_name,
                    status=out.status, finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens,
                    ttft_s=round(out.ttft, 4) if out.ttft is not None else None, e2e_s=round(e2e, 4),
                    decode=out.decode, prefill=out.prefill)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context) -> generation_pb2.TokenizeResponse:
        ids = await self._prompt_ids(request, context)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    async def ListModels(self, request, context) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=self.model_name, max_model_len=self.router.max_model_len)])


async def serve(model_dir: Path, host: str, port: int, prefill: list[str], decode: list[str],
                ready_timeout: float = 300.0, tracing: Tracing | None = None,
                metrics: GatewayMetrics | None = None, discover: bool = False, poll_interval: float = 1.0
                ) -> tuple[RunningServer, Router]:
    tracing = tracing or Tracing("pdserve-gateway")
    tokenizer = Tokenizer(model_dir)
    router = Router(prefill, decode, poll_interval=poll_interval, interceptors=tracing.client_interceptors(),
                    discover=discover)
    servicer = GenerationServicer(tokenizer, model_dir.name, router, tracer=tracing.tracer, metrics=metrics)
    servicer.metrics.bind_router(router.counts)
    running = await start_server(
        host, port, lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        interceptors=tracing.server_interceptors(), serving=False)
    await router.start()
    try:
        await router.wait_ready(ready_timeout)
    except NoWorkerAvailable as e:
        log.warning("%s; serving anyway (requests get UNAVAILABLE until workers answer)", e)
    await running.serving()
    log.info("gateway on %s:%d (prefill %s, decode %s)", host, running.port, prefill, decode)
    return running, router
