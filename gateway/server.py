"""The public gRPC API: validates, tokenizes, routes to a decode worker (which pulls in a prefill worker), and
streams text back with stop strings applied."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import grpc

from gateway.router import NoWorkerAvailable, Router
from gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
from gateway.tokenizer import Tokenizer
from pdserve.grpc_server import start_server
from protos import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_STOP_STRINGS = 16


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, model_name: str, router: Router, max_attempts: int = 3) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.router = router
        self.max_attempts = max_attempts

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
        start = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        prompt_ids = await self._prompt_ids(request, context)
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
            try:
                decode, prefill = self.router.pick(tried)
            except NoWorkerAvailable as e:
                if last_error is not None:  # every worker left was tried: report what the last one said
                    await context.abort(last_error.code(), last_error.details() or last_error.code().name)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            decode.inflight += 1
            prefill.inflight += 1
            prefill_pending = True
            call = decode.stub.Decode(
                worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                                         prefill_address=prefill.address),
                timeout=context.time_remaining())
            streamed = False
            try:
                async for resp in call:
                    if prefill_pending:
                        prefill.inflight -= 1
                        prefill_pending = False
                        usage.cached_prompt_tokens = resp.cached_prompt_tokens
                    streamed = True
                    usage.completion_tokens += len(resp.token_ids)
                    text = matcher.feed(detok.add(resp.token_ids))
                    finish = resp.finish_reason
                    if matcher.stopped:
                        finish = common_pb2.FINISH_REASON_STOP
                    elif finish:
                        text += matcher.feed(detok.flush()) + matcher.flush()
                    out = generation_pb2.GenerateResponse(request_id=rid, text=text, token_ids=resp.token_ids,
                                                          logprobs=resp.logprobs, finish_reason=finish)
                    if finish:
                        out.usage.CopyFrom(usage)
                    yield out
                    if finish:
                        log.info("request %s done: %d+%d tokens in %.3fs, finish=%s", rid, usage.prompt_tokens,
                                 usage.completion_tokens, time.perf_counter() - start,
                                 common_pb2.FinishReason.Name(finish))
                        return
                await context.abort(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if not streamed and code in RETRYABLE and attempt + 1 < self.max_attempts:
                    log.warning("request %s: %s via %s/%s (%s); retrying elsewhere", rid, code.name,
                                decode.address, prefill.address, e.details())
                    if code == grpc.StatusCode.UNAVAILABLE:
                        culprit = prefill.address if prefill.address in (e.details() or "") else decode.address
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

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context) -> generation_pb2.TokenizeResponse:
        ids = await self._prompt_ids(request, context)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    async def ListModels(self, request, context) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=self.model_name, max_model_len=self.router.max_model_len)])


async def serve(model_dir: Path, host: str, port: int, prefill: list[str], decode: list[str],
                ready_timeout: float = 300.0) -> tuple[grpc.aio.Server, int, Router]:
    tokenizer = Tokenizer(model_dir)
    router = Router(prefill, decode)
    await router.start()
    try:
        await router.wait_ready(ready_timeout)
    except NoWorkerAvailable as e:
        log.warning("%s; serving anyway (requests get UNAVAILABLE until workers answer)", e)
    servicer = GenerationServicer(tokenizer, model_dir.name, router)
    server, bound, _ = await start_server(
        host, port, lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name])
    log.info("gateway on %s:%d (prefill %s, decode %s)", host, bound, prefill, decode)
    return server, bound, router
