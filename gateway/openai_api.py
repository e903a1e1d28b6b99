"""The OpenAI-compatible HTTP API: a second front door onto the gateway's request path.

`POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events exactly as OpenAI frames them,
`data: [DONE]` last), `GET /v1/models`, `GET /health`, `GET /metrics`. Bodies are read here (size and time bounded),
parsed by `openai_protocol`, answered through `openai_render`; every failure is a `RequestError` whose row in the
failure table gives its HTTP status and OpenAI error. A client that goes away cancels its request on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.gateway import choices
from pdserve.gateway.observe import http_span, http_span_answered
from pdserve.gateway.openai_protocol import parse_body, parse_request
from pdserve.gateway.openai_render import Renderer, error_body, error_response
from pdserve.gateway.request import Delta, GenerationRequest, RequestError
from pdserve.gateway.request_path import RequestPath
from pdserve.options import HTTPOptions
from pdserve.protos import common_pb2
from pdserve.security import key_matches

PARSE_ON_LOOP = 64 << 10  # bodies up to this size are parsed on the event loop; larger ones on a thread


class OpenAIFront:
    """The routes' work, for one request path: authorize, read and parse the body, answer whole or streamed."""

    def __init__(self, path: RequestPath, api_key: str | None, tracer: trace.Tracer, limits: HTTPOptions) -> None:
        self.path, self.api_key, self.tracer, self.limits = path, api_key, tracer, limits

    def authorize(self, request: Request) -> None:
        if self.api_key and not key_matches(request.headers.get("authorization"), self.api_key):
            raise RequestError("unauthenticated", "missing or wrong API key: send 'Authorization: Bearer <key>'")

    def answered(self, request: Request, build: Callable[[], Response]) -> Response:
        """`build()`'s response for an authorized caller; OpenAI's error shape for any RequestError."""
        try:
            self.authorize(request)
            return build()
        except RequestError as e:
            return error_response(e)

    def model_card(self, model: str | None = None) -> dict:
        if model is not None and model != self.path.model_name:
            raise RequestError(
                "model_not_found",
                f"the model {model!r} does not exist; this server serves {self.path.model_name!r}",
                "model",
            )
        return {
            "id": self.path.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self.path.router.max_model_len,
        }

    async def _read(self, request: Request) -> bytes:
        max_body = self.limits.http_max_body
        too_large = f"the request body is larger than this gateway takes ({max_body} bytes)"
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise RequestError("request_too_large", too_large)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise RequestError("request_too_large", too_large)
            chunks.append(chunk)
        return b"".join(chunks)

    async def body(self, request: Request) -> dict:
        try:
            raw = await asyncio.wait_for(self._read(request), self.limits.http_body_timeout)
        except TimeoutError:
            message = f"the request body took longer than {self.limits.http_body_timeout:.0f}s to arrive"
            raise RequestError("request_timeout", message) from None
        if len(raw) <= PARSE_ON_LOOP:
            return parse_body(raw)
        return await asyncio.to_thread(parse_body, raw)

    async def generate(self, request: Request, chat: bool) -> Response:
        """One generation request inside its HTTP server span (which a stream ends when it ends)."""
        span = http_span(self.tracer, request, "/v1/chat/completions" if chat else "/v1/completions")
        response = None
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await self.answer(span, request, chat)
                return response
        finally:
            http_span_answered(span, response)

    async def answer(self, span: trace.Span, request: Request, chat: bool) -> Response:
        """The response to one generation request: an error, a whole completion, or a stream."""
        try:
            self.authorize(request)
            parsed = parse_request(await self.body(request), chat, self.path.tokenizer.renders_tools)
            self.path.check(parsed.request)
        except RequestError as e:
            span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
            return error_response(e)
        req = parsed.request
        renderer = Renderer(
            self.path.tokenizer, chat, req.model or self.path.model_name, parsed.top_logprobs, parsed.tools
        )
        if parsed.stream:
            return StreamingResponse(
                _sse(self.path, req, renderer, parsed.include_usage, span, parsed.n),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(self.path, req, renderer, request, parsed.n, parsed.best_of)


def create_app(path: RequestPath, api_key: str | None, tracer: trace.Tracer, limits: HTTPOptions) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    front = OpenAIFront(path, api_key, tracer, limits)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = any(w.healthy for w in path.router.decode)
        return JSONResponse({"status": "ok" if ready else "no healthy worker"}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return front.answered(request, lambda: JSONResponse({"object": "list", "data": [front.model_card()]}))

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        return front.answered(request, lambda: JSONResponse(front.model_card(model)))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The gateway's Prometheus page on the API port too (benchmark clients look there); behind the key."""
        page = generate_latest(path.metrics.registry)
        return front.answered(request, lambda: Response(page, media_type=CONTENT_TYPE_LATEST))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, chat=True)

    return app


async def _complete(
    path: RequestPath, req: GenerationRequest, renderer: Renderer, request: Request, n: int = 1, best_of: int = 1
) -> Response:
    """The whole answer at once (`best_of` choices generated, the `n` best returned); the request is cancelled if
    the client disconnects first."""

    async def run() -> JSONResponse:
        deltas: list[list[Delta]] = [[] for _ in range(best_of)]
        async for i, delta in choices.run(path, choices.children(req, best_of), "http"):
            deltas[i].append(delta)
        ranked = sorted(range(best_of), key=lambda i: -choices.mean_logprob(deltas[i]))[:n] if best_of > n else range(n)
        rendered = []
        for index, i in enumerate(ranked):
            merged = Delta.joined(deltas[i])
            assert merged.finish_reason is not None, "the last delta ends the request"
            one = renderer.for_choice(index)
            rendered.append(one.choice(merged.text, one.logprobs(merged), merged.finish_reason))
        usage = choices.merged_usage([d[-1].usage for d in deltas if d[-1].usage is not None])
        return JSONResponse(renderer.response(rendered, usage))

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # the client left: cancel the request everywhere
        for task in (watch, work):  # a cancelled task is cancelled only once it has run to its end
            with contextlib.suppress(BaseException):
                await task
    if work.cancelled():
        return JSONResponse({}, status_code=499)
    try:
        return work.result()
    except RequestError as e:
        return error_response(e)


async def _sse(
    path: RequestPath, req: GenerationRequest, renderer: Renderer, include_usage: bool, span: trace.Span, n: int = 1
) -> AsyncIterator[str]:
    renderers = [renderer.for_choice(i) for i in range(n)]
    usages: dict[int, common_pb2.Usage] = {}
    try:
        with trace.use_span(span, end_on_exit=False):
            try:
                async for i, delta in choices.run(path, choices.children(req, n), "http"):
                    for choice in renderers[i].stream_choices(delta):
                        yield renderer.chunk([choice], None)
                    if delta.finish_reason and delta.usage is not None:
                        usages[i] = delta.usage
                if include_usage and usages:
                    yield renderer.chunk([], renderer.usage(choices.merged_usage([usages[i] for i in sorted(usages)])))
            except RequestError as e:  # the status line is sent: the error travels as an event, as vLLM does
                span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
                _, body = error_body(e)
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        span.end()
