"""The gateway process: the public gRPC API (`pdserve.v1.Generation`) and, beside it, the OpenAI-compatible HTTP
API, both front doors onto one request path (`request_path.py`)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from pdserve.config import GatewayConfig
from pdserve.failures import public_metadata
from pdserve.finish_reason import to_proto
from pdserve.gateway.http_server import HTTPServer
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_api import create_app
from pdserve.gateway.request import GenerationRequest, RequestError
from pdserve.gateway.request_path import RequestPath
from pdserve.gateway.router import NoWorkerAvailable, Router
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.grpc_server import RunningServer, start_server
from pdserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from pdserve.security import ApiKeyInterceptor, TLSConfig
from pdserve.tracing import Tracing

log = logging.getLogger(__name__)


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


async def _abort(context: grpc.aio.ServicerContext, e: RequestError) -> None:
    """End a public call with a request's failure: its row's status, the message, the label and the parameter."""
    await context.abort(e.code, e.message, public_metadata(e.failure, e.param))


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, path: RequestPath) -> None:
        self.path = path

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        req = request_from_proto(request, context)
        try:
            async for delta in self.path.run(req, "grpc"):
                msg = generation_pb2.GenerateResponse(
                    request_id=req.request_id, text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs
                )
                if delta.finish_reason:
                    msg.finish_reason = to_proto(delta.finish_reason)
                    msg.usage.CopyFrom(delta.usage)
                yield msg
        except RequestError as e:
            await _abort(context, e)

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        req = GenerationRequest("tokenize", common_pb2.SamplingParams(), model=request.model)
        if request.WhichOneof("input") == "chat":
            req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        else:
            req.prompt = request.prompt
        try:
            ids = await self.path.prompt_ids(req)
        except RequestError as e:
            await _abort(context, e)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.path.tokenizer.convert_ids_to_tokens(ids))

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=self.path.model_name, max_model_len=self.path.router.max_model_len)]
        )


async def serve(
    cfg: GatewayConfig, model_dir: Path, tls: TLSConfig | None, tracing: Tracing, metrics: GatewayMetrics
) -> tuple[RunningServer, Router, RequestPath, HTTPServer | None]:
    """Bind the public ports first (a busy port fails at once), wait for workers, then say SERVING. With an HTTP
    port (>= 0) the OpenAI-compatible HTTP API is served too, on the same request path."""
    host, port = cfg.server.host, cfg.server.port
    router = Router(
        cfg.prefill.addresses,
        cfg.gateway.decode_addresses,
        poll_interval=cfg.gateway.poll_interval,
        idle_poll_interval=cfg.gateway.idle_poll_interval,
        interceptors=tracing.client_interceptors(),
        discover=cfg.gateway.discover,
        tls=tls,
        kv_aware=cfg.routing.routing == "kv-aware",
        overlap_weight=cfg.routing.overlap_weight,
        model=model_dir.name,
    )
    path = RequestPath(
        Tokenizer(model_dir),
        model_dir.name,
        router,
        cfg.migration,
        cfg.gateway.max_prompt_bytes,
        tracing.tracer,
        metrics,
    )
    metrics.bind_router(router.counts, router.indexed)
    api_key = cfg.api_key.api_key
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
    try:
        http = await _http(cfg, path, tls, tracing) if cfg.http.http_port >= 0 else None
    except BaseException:
        await running.server.stop(None)
        raise
    await router.start()
    try:
        await router.wait_ready(cfg.gateway.ready_timeout)
    except NoWorkerAvailable as e:
        log.warning("%s; serving anyway (requests get UNAVAILABLE until workers answer)", e)
    await running.serving()
    log.info(
        "gateway on %s:%d (prefill %s, decode %s)",
        host,
        running.port,
        cfg.prefill.addresses,
        cfg.gateway.decode_addresses,
    )
    return running, router, path, http


async def _http(cfg: GatewayConfig, path: RequestPath, tls: TLSConfig | None, tracing: Tracing) -> HTTPServer:
    """The OpenAI-compatible HTTP API on the same request path, started."""
    app = create_app(path, cfg.api_key.api_key, tracing.tracer, cfg.http)
    http = await HTTPServer(app, cfg.http.http_host or cfg.server.host, cfg.http, tls).start()
    log.info("OpenAI-compatible API on %s", http.url)
    return http
