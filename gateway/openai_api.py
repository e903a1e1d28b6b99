"""The OpenAI-compatible HTTP API: a second front door onto the gateway's request path.

`POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events exactly as OpenAI frames them,
`data: [DONE]` last), `GET /v1/models`, `GET /health`. Parameters are OpenAI's plus vLLM's extras (top_k, min_p,
min_tokens, ignore_eos, repetition_penalty) and logit_bias; a parameter it does not implement (tools,
response_format other than text, ...) or does not know gets a 400 naming it, as OpenAI answers. Errors come in OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that matches. A client that goes
away cancels its request on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import resource
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.gateway.request_path import Delta, GenerationRequest, RequestError, RequestPath, invalid
from pdserve.grpc_server import PortInUse, check_free
from pdserve.protos import common_pb2
from pdserve.security import TLSConfig, key_matches
from pdserve.tracing import Tracing, extract

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
ERROR_CODES = {404: "model_not_found", 401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "service_unavailable"}
MAX_TOP_LOGPROBS = 20
PARSE_ON_LOOP = 64 << 10  # bodies up to this size are parsed on the event loop; larger ones on a thread
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPLimits:
    """What one HTTP client may cost the gateway before it has sent a request worth serving."""

    max_body: int = 4 << 20  # bytes; larger bodies get 413 before they are read
    header_timeout: float = 10.0  # seconds a connection may take to send a request's head (slowloris)
    body_timeout: float = 30.0  # seconds a request may take to send its body
    max_connections: int = 0  # open connections at once (0: half of this process's file-descriptor limit)

    def connections(self) -> int:
        if self.max_connections > 0:
            return self.max_connections
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) // 2)


class HTTPError(Exception):
    """A refusal before the request is understood (413, 408): OpenAI's error shape, with its own status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = "invalid_request_error"
        code = {413: "request_too_large", 408: "request_timeout"}.get(self.status, "invalid_request")
        return JSONResponse(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}},
            status_code=self.status,
        )


def error_body(e: RequestError) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(e.code, (500, "server_error"))
    return status, {
        "error": {
            "message": e.message,
            "type": kind,
            "param": e.param,
            "code": ERROR_CODES.get(status, e.code.name.lower()),
        }
    }


def _error_response(e: RequestError) -> JSONResponse:
    status, body = error_body(e)
    return JSONResponse(body, status_code=status)


# ---- parameters ----------------------------------------------------------------------------------------------


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise invalid(name, f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise invalid(name, f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


_INT_RANGES = {  # the proto fields' ranges: a value beyond them is the caller's error, not a protobuf exception
    "max_tokens": (0, 2**32 - 1),
    "min_tokens": (0, 2**32 - 1),
    "top_k": (-(2**31), 2**31 - 1),
    "seed": (0, 2**64 - 1),
}


def _set_int(s: common_pb2.SamplingParams, name: str, value: int) -> None:
    low, high = _INT_RANGES[name]
    if not low <= value <= high:
        raise invalid(name, f"{name} must be in [{low}, {high}], got {value}")
    setattr(s, name, value)


# OpenAI parameters this server does not implement: refused by name rather than silently ignored (OpenAI itself
# refuses arguments it does not know); `response_format: {"type": "text"}` is the default and accepted
UNSUPPORTED: tuple[str, ...] = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
UNSUPPORTED += ("audio", "modalities", "prediction", "web_search_options", "reasoning_effort")


_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs"}
_COMMON |= {"presence_penalty", "frequency_penalty", "logit_bias", "user", "metadata", "store", "service_tier"}
_COMMON |= {"top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids"}  # vLLM's extras
KNOWN = {
    False: _COMMON | {"prompt", "echo", "best_of", "suffix"},
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"},
}


def _refuse_unsupported(body: dict, chat: bool) -> None:
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise invalid(name, f"{name} is not supported by this server")
    for name in body:
        if name not in KNOWN[chat] and name not in UNSUPPORTED:
            raise invalid(name, f"unknown parameter {name!r}")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("response_format", "response_format is not supported by this server (only {'type': 'text'})")


def _logit_bias(body: dict, s: common_pb2.SamplingParams) -> None:
    bias = _get(body, "logit_bias", (dict,))
    if not bias:
        return
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < 2**32):
            raise invalid("logit_bias", f"logit_bias keys must be token ids (as strings), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {value!r}")
        s.logit_bias[int(key)] = float(value)


def _sampling(body: dict, chat: bool) -> tuple[common_pb2.SamplingParams, list[str], int | None]:
    """The workers' sampling params, the stop strings, and how many top logprobs to return (None: none)."""
    _refuse_unsupported(body, chat)
    s = common_pb2.SamplingParams()
    _logit_bias(body, s)
    max_tokens = _get(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", (int,))
    if max_tokens is not None:
        if max_tokens < 1:
            raise invalid("max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
        _set_int(s, "max_tokens", max_tokens)
    elif not chat:
        s.max_tokens = 16  # OpenAI's default for completions
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _get(body, name, (int, float))
        if value is not None:
            setattr(s, name, float(value))
    for name in ("top_k", "min_tokens", "seed"):
        value = _get(body, name, (int,))
        if value is not None:
            if name != "top_k" and value < 0:
                raise invalid(name, f"{name} must be >= 0, got {value}")
            _set_int(s, name, value)
    if _get(body, "ignore_eos", (bool,), False):
        s.ignore_eos = True
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in stop_ids):
        raise invalid("stop_token_ids", "stop_token_ids must be a list of token ids")
    s.stop_token_ids.extend(stop_ids)
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise invalid("n", "n must be 1: this server returns one choice per request")
    if _get(body, "best_of", (int,), 1) != 1:
        raise invalid("best_of", "best_of must be 1")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(x, str) for x in stop):
        raise invalid("stop", "stop must be a string or a list of strings")
    if chat:
        top = None
        if _get(body, "logprobs", (bool,), False):
            top = _get(body, "top_logprobs", (int,), 0)
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        elif body.get("top_logprobs") is not None:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        top = _get(body, "logprobs", (int,))
        if top is not None and not 0 <= top <= 5:
            raise invalid("logprobs", "logprobs must be in [0, 5]")
        if _get(body, "echo", (bool,), False):
            raise invalid("echo", "echo is not supported")
        if _get(body, "suffix", (str,)):
            raise invalid("suffix", "suffix is not supported")
    if top is not None:
        s.logprobs = top
    return s, list(stop), top


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}]", "each message needs a role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content", "content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    raise invalid("prompt", "prompt must be a string or a list of token ids (one prompt per request)")


# ---- responses -----------------------------------------------------------------------------------------------


class _Renderer:
    """Turns the request path's deltas into OpenAI's JSON, for one request."""

    def __init__(self, path: RequestPath, chat: bool, model: str, top: int | None) -> None:
        self.path, self.chat, self.model, self.top = path, chat, model, top
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offset = 0

    def _token(self, token_id: int) -> str:
        return self.path.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, delta: Delta) -> dict | None:
        if self.top is None:
            return None
        if self.chat:
            content = []
            for lp in delta.logprobs:
                token = self._token(lp.token_id)
                content.append(
                    {
                        "token": token,
                        "logprob": lp.logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": (t := self._token(x.token_id)), "logprob": x.logprob, "bytes": list(t.encode())}
                            for x in lp.top
                        ],
                    }
                )
            return {"content": content}
        tokens, offsets = [], []
        for lp in delta.logprobs:
            tokens.append(self._token(lp.token_id))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in delta.logprobs],
            "top_logprobs": [{self._token(x.token_id): x.logprob for x in lp.top} for lp in delta.logprobs],
            "text_offset": offsets,
        }

    @staticmethod
    def usage(u: common_pb2.Usage) -> dict:
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        }

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def stream_choice(self, delta: Delta, first: bool) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            if delta.finish_reason and not delta.text and not first:
                d = {}
            return {"index": 0, "delta": d, "logprobs": self.logprobs(delta), "finish_reason": delta.finish_reason}
        return {"index": 0, "text": delta.text, "logprobs": self.logprobs(delta), "finish_reason": delta.finish_reason}

    def whole(self, text: str, logprobs: dict | None, finish: str, usage: common_pb2.Usage) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(usage),
        }


# ---- the app -------------------------------------------------------------------------------------------------


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict:
    """The body's JSON object; RequestError naming what is wrong (bad JSON, nesting too deep for the parser, a
    lone surrogate, which no tokenizer or protobuf string can hold)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid(None, "the request body nests too deeply") from None
    except ValueError as e:
        raise invalid(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    if not _SURROGATE_ESCAPE.search(raw):  # valid UTF-8 holds no surrogates: only a \uD8xx..\uDFxx escape can
        return body
    for name, value in body.items():
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid(name, f"{name} holds a lone UTF-16 surrogate: not valid Unicode text") from None
        except RecursionError:
            raise invalid(name, f"{name} nests too deeply") from None
    return body


def create_app(
    path: RequestPath,
    api_key: str | None = None,
    tracing: Tracing | None = None,
    limits: HTTPLimits = HTTPLimits(),
) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    tracer = tracing.tracer if tracing is not None else trace.NoOpTracer()

    def authorize(request: Request) -> None:
        if api_key and not key_matches(request.headers.get("authorization"), api_key):
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send 'Authorization: Bearer <key>'"
            )

    too_large = f"the request body is larger than this gateway takes ({limits.max_body} bytes)"

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body:
            raise HTTPError(413, too_large)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body:
                raise HTTPError(413, too_large)
            chunks.append(chunk)
        return b"".join(chunks)

    async def body_of(request: Request) -> dict:
        try:
            raw = await asyncio.wait_for(read_body(request), limits.body_timeout)
        except TimeoutError:
            raise HTTPError(408, f"the request body took longer than {limits.body_timeout:.0f}s to arrive") from None
        if len(raw) <= PARSE_ON_LOOP:
            return parse_body(raw)
        return await asyncio.to_thread(parse_body, raw)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = any(w.healthy for w in path.router.decode)
        return JSONResponse({"status": "ok" if ready else "no healthy worker"}, status_code=200 if ready else 503)

    def model_card() -> dict:
        return {
            "id": path.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": path.router.max_model_len,
        }

    def answered(request: Request, build) -> Response:
        """`build()`'s response for an authorized caller; OpenAI's error shape for any RequestError."""
        try:
            authorize(request)
            return build()
        except RequestError as e:
            return _error_response(e)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return answered(request, lambda: JSONResponse({"object": "list", "data": [model_card()]}))

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        def card() -> JSONResponse:
            if model != path.model_name:
                raise RequestError(
                    grpc.StatusCode.NOT_FOUND,
                    f"the model {model!r} does not exist; this server serves {path.model_name!r}",
                    "model",
                )
            return JSONResponse(model_card())

        return answered(request, card)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The gateway's Prometheus page on the API port too (benchmark clients look there); behind the key."""
        return answered(
            request, lambda: Response(generate_latest(path.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        )

    async def generate(request: Request, chat: bool):
        name = "/v1/chat/completions" if chat else "/v1/completions"
        span = tracer.start_span(
            f"POST {name}",
            kind=trace.SpanKind.SERVER,
            context=extract(dict(request.headers)),
            attributes={  # HTTP semantic conventions: what trace backends filter and group by
                "http.request.method": "POST",
                "http.route": name,
                "url.path": request.url.path,
                "url.scheme": request.url.scheme,
                "network.protocol.version": request.scope.get("http_version", "1.1"),
                "user_agent.original": request.headers.get("user-agent", ""),
            },
        )
        streaming = False
        response = None
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await answer(span, request, chat)
                streaming = isinstance(response, StreamingResponse)
                return response
        finally:
            if response is not None:
                span.set_attribute("http.response.status_code", response.status_code)
                if response.status_code >= 400:
                    span.set_attribute("error.type", str(response.status_code))
            if not streaming:
                span.end()

    async def answer(span: trace.Span, request: Request, chat: bool) -> Response:
        """The response to one generation request: an error, a whole completion, or a stream (whose span ends
        with it)."""
        try:
            authorize(request)
            body = await body_of(request)
            sampling, stop, top = _sampling(body, chat)
            model = _get(body, "model", (str,), "")
            req = GenerationRequest(uuid.uuid4().hex, sampling, stop=stop, model=model)
            if chat:
                req.messages = _messages(body)
            else:
                req.prompt, req.token_ids = _prompt(body)
            stream = _get(body, "stream", (bool,), False)
            options = _get(body, "stream_options", (dict,), {}) or {}
            include_usage = bool(options.get("include_usage")) if stream else False
            path.check(req)
        except RequestError as e:
            span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
            return _error_response(e)
        except HTTPError as e:
            span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
            return e.response()
        renderer = _Renderer(path, chat, model or path.model_name, top)
        if stream:
            return StreamingResponse(
                _sse(path, req, renderer, include_usage, span),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(path, req, renderer, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


async def _complete(path: RequestPath, req: GenerationRequest, renderer: _Renderer, request: Request):
    """The whole answer at once; the request is cancelled if the client disconnects first."""

    async def run() -> JSONResponse:
        deltas = [delta async for delta in path.run(req, "http")]
        last = deltas[-1]
        merged = Delta(
            "".join(d.text for d in deltas),
            [t for d in deltas for t in d.token_ids],
            [lp for d in deltas for lp in d.logprobs],
        )
        assert last.finish_reason is not None and last.usage is not None, "the last delta ends the request"
        return JSONResponse(renderer.whole(merged.text, renderer.logprobs(merged), last.finish_reason, last.usage))

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
        with contextlib.suppress(BaseException):
            await watch
    if work.cancelled():
        return JSONResponse({}, status_code=499)
    try:
        return work.result()
    except RequestError as e:
        return _error_response(e)


async def _sse(
    path: RequestPath, req: GenerationRequest, renderer: _Renderer, include_usage: bool, span: trace.Span
) -> AsyncIterator[str]:
    first = True
    try:
        with trace.use_span(span, end_on_exit=False):
            try:
                async for delta in path.run(req, "http"):
                    yield renderer.chunk([renderer.stream_choice(delta, first)], None)
                    first = False
                    if delta.finish_reason and include_usage and delta.usage is not None:
                        yield renderer.chunk([], renderer.usage(delta.usage))
            except RequestError as e:  # the status line is sent: the error travels as an event, as vLLM does
                span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
                _, body = error_body(e)
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        span.end()


class HTTPServer:
    """uvicorn serving the app inside the gateway's own event loop (its signals stay the gateway's)."""

    def __init__(
        self, app: FastAPI, host: str, port: int, tls: TLSConfig | None = None, limits: HTTPLimits = HTTPLimits()
    ) -> None:
        guarded = type(
            "GuardedH11",
            (_GuardedH11,),
            {"max_connections": limits.connections(), "header_timeout": limits.header_timeout},
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=guarded,
            h11_max_incomplete_event_size=64 << 10,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=tls.cert if tls and tls.enabled else None,
            ssl_keyfile=tls.key if tls and tls.enabled else None,
            timeout_graceful_shutdown=30,
        )
        self.server = _Server(config)
        self.host, self.port = host, port
        self._task: asyncio.Task | None = None

    async def start(self) -> HTTPServer:
        check_free(self.host, self.port)
        self._task = asyncio.create_task(self.server.serve(), name="http")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise PortInUse(f"cannot listen on {self.host}:{self.port}")
            await asyncio.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with what it lacks against slow or too many clients: a connection past the cap is
    closed at once, and one that has not sent a whole request head within `header_timeout` (at the start, or
    between requests on a kept-alive connection) is closed."""

    max_connections = 1024
    header_timeout = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            transport.abort()
            log.debug("HTTP connection refused: %d are open (the cap)", self.max_connections)
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():
            if self._head_timer is None:
                self._arm()
        else:
            self._disarm()

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield
