"""The gateway process: the public gRPC API (`pdserve.v1.Generation`) and, beside it, the OpenAI-compatible HTTP
API, both front doors onto one request path (`request_path.py`)."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import grpc

from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_api import HTTPLimits, HTTPServer, create_app
from pdserve.gateway.request_path import GenerationRequest, RequestError, RequestPath
from pdserve.gateway.router import NoWorkerAvailable, Router
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.grpc_server import RunningServer, start_server
from pdserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from pdserve.security import ApiKeyInterceptor, TLSConfig
from pdserve.tracing import Tracing

log = logging.getLogger(__name__)

FINISH_PROTO = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def request_from_proto(request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationRequest:
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    stop = list(sampling.stop)
    del sampling.stop[:]
    remaining = context.time_remaining()
    req = GenerationRequest(
        request.request_id or uuid.uuid4().hex,
        sampling,
        stop=stop,
        model=request.model,
        deadline=time.monotonic() + remaining if remaining is not None else None,
    )
    kind = request.WhichOneof("input")
    if kind == "prompt":
        req.prompt = request.prompt
    elif kind == "chat":
        req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    elif kind == "token_ids":
        req.token_ids = list(request.token_ids.ids)
    else:
        req.prompt = ""
    return req


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, path: RequestPath) -> None:
        self.path = path

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        req = request_from_proto(request, context)
        try:
            async for delta in self.path.run(req, "grpc"):
                msg = generation_pb2.GenerateResponse(
                    request_id=req.request_id, text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs
                )
                if delta.finish_reason:
                    msg.finish_reason = FINISH_PROTO[delta.finish_reason]
                    msg.usage.CopyFrom(delta.usage)
                yield msg
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context) -> generation_pb2.TokenizeResponse:
        req = GenerationRequest("tokenize", common_pb2.SamplingParams(), model=request.model)
        if request.WhichOneof("input") == "chat":
            req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        else:
            req.prompt = request.prompt
        try:
            ids = await self.path.prompt_ids(req)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.path.tokenizer.convert_ids_to_tokens(ids))

    async def ListModels(self, request, context) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=self.path.model_name, max_model_len=self.path.router.max_model_len)]
        )


async def serve(
    model_dir: Path,
    host: str,
    port: int,
    prefill: list[str],
    decode: list[str],
    ready_timeout: float = 300.0,
    tracing: Tracing | None = None,
    metrics: GatewayMetrics | None = None,
    discover: bool = False,
    poll_interval: float = 1.0,
    tls: TLSConfig | None = None,
    api_key: str | None = None,
    max_prompt_bytes: int = 1 << 20,
    http_host: str | None = None,
    http_port: int = -1,
    kv_aware: bool = True,
    overlap_weight: float = 1.0,
    http_limits: HTTPLimits | None = None,
    migration_limit: int = 3,
    migration_max_tokens: int = 32768,
    worker_wait: float = 10.0,
) -> tuple[RunningServer, Router, RequestPath, HTTPServer | None]:
    """Bind the public ports first (a busy port fails at once), wait for workers, then say SERVING. With
    `http_port` >= 0 the OpenAI-compatible HTTP API is served too, on the same request path."""
    tracing = tracing or Tracing("pdserve-gateway")
    tokenizer = Tokenizer(model_dir)
    router = Router(
        prefill,
        decode,
        poll_interval=poll_interval,
        interceptors=tracing.client_interceptors(),
        discover=discover,
        tls=tls,
        kv_aware=kv_aware,
        overlap_weight=overlap_weight,
        model=model_dir.name,
    )
    path = RequestPath(
        tokenizer,
        model_dir.name,
        router,
        max_prompt_bytes=max_prompt_bytes,
        migration_limit=migration_limit,
        migration_max_tokens=migration_max_tokens,
        worker_wait=worker_wait,
        tracer=tracing.tracer,
        metrics=metrics,
    )
    path.metrics.bind_router(router.counts, router.indexed)
    interceptors = [*tracing.server_interceptors(), *([ApiKeyInterceptor(api_key)] if api_key else [])]
    running = await start_server(
        host,
        port,
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(path), s),
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        interceptors=interceptors,
        serving=False,
        tls=tls,
        require_client_cert=False,
    )
    http = None
    if http_port >= 0:
        try:
            limits = http_limits or HTTPLimits()
            app = create_app(path, api_key, tracing, limits)
            http = await HTTPServer(app, http_host or host, http_port, tls, limits).start()
        except BaseException:
            await running.server.stop(None)
            raise
        log.info("OpenAI-compatible API on %s", http.url)
    await router.start()
    try:
        await router.wait_ready(ready_timeout)
    except NoWorkerAvailable as e:
        log.warning("%s; serving anyway (requests get UNAVAILABLE until workers answer)", e)
    await running.serving()
    log.info("gateway on %s:%d (prefill %s, decode %s)", host, running.port, prefill, decode)
    return running, router, path, http
